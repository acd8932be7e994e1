#!/usr/bin/env bash
# mpirun killed with SIGKILL cannot tell its ranks: each rank must notice that its launcher is gone
# and end within a few seconds (the watchdog checks its parent twice a second), on either backend.
#   launcher_killed.sh <fivefold> <mpi|gloo>
set -u
program=$1
backend=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Gloo: mpirun killed while rank 0 waits in the rendezvous for rank 1, a `sleep` that never
# arrives: rank 0 must end too, not wait out the rendezvous's timeout (600 s). Shown to fail with
# the launcher's watch started after the ranks have met (rank 0 still waiting after 5 s).
if [ "$backend" = gloo ]; then
  FIVEFOLD_BACKEND=gloo mpirun --oversubscribe -np 1 "$program" train --out '' --steps 1 \
    --no-progress : -np 1 sleep 120 >"$work/meet.log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 300); do  # up to 30 s: until rank 0 has made the rendezvous file
    compgen -G "/tmp/fivefold-rendezvous-*-$launcher-*" >/dev/null && break
    sleep 0.1
  done
  rank0=$(pgrep -P "$launcher" -x fivefold)
  sleeper=$(pgrep -P "$launcher" -x sleep)
  kill -9 "$launcher"
  ended=""
  for _ in $(seq 1 50); do
    kill -0 "$rank0" 2>/dev/null || { ended=1; break; }
    sleep 0.1
  done
  kill -9 $sleeper 2>/dev/null
  if [ -z "$ended" ]; then
    cat "$work/meet.log"
    echo "FAIL: rank 0 (pid $rank0) still waiting in the rendezvous 5 s after mpirun was killed"
    kill -9 "$rank0" 2>/dev/null
    exit 1
  fi
  echo "rank 0 ended in the rendezvous after its launcher was killed (gloo)"
fi

# Starts the job in the background (launcher: its mpirun) and waits until training has started
# (rank 0 writes a metrics line). Returns 1 if it did not start.
start_job() {
  rm -rf "$work/run"
  FIVEFOLD_BACKEND=$backend mpirun --oversubscribe -np 2 "$program" train --out "$work/run" \
    --steps 1000000 --d-model 32 --n-layers 1 --n-heads 4 --d-ff 64 --seq 16 --batch 4 \
    --synthetic-examples 300 --peak-gflops 100 --no-progress --exact-match 0 --eval-every 0 \
    --save-every 0 >"$work/log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 300); do
    [ -s "$work/run/metrics.jsonl" ] && break
    sleep 0.1
  done
  ranks=$(pgrep -P "$launcher" | tr '\n' ' ')
  [ -s "$work/run/metrics.jsonl" ] && [ -n "$ranks" ]
}
if ! start_job; then
  cat "$work/log"
  kill -9 "$launcher" $ranks 2>/dev/null
  wait "$launcher" 2>/dev/null
  # Gloo's TCP transport has failed this way at start-up in CI-sized runs, never in a rerun
  # (cmake/retry-gloo-transport.cmake): once more, and only for that failure.
  if ! grep -Eq 'gloo/transport/tcp/pair\.cc:[0-9]+\] Connection closed by peer' "$work/log" ||
     { echo "RETRY: the job failed on Gloo's TCP transport before training; starting it once more"
       ! start_job; }; then
    cat "$work/log"
    echo "FAIL: the job did not start training"
    kill -9 "$launcher" $ranks 2>/dev/null
    exit 1
  fi
fi
kill -9 "$launcher"
for _ in $(seq 1 50); do  # up to 5 s
  alive=""
  for r in $ranks; do kill -0 "$r" 2>/dev/null && alive="$alive $r"; done
  [ -z "$alive" ] && { echo "ranks $ranks ended after their launcher was killed ($backend)"; exit 0; }
  sleep 0.1
done
echo "FAIL: ranks$alive still running 5 s after mpirun was killed ($backend)"
kill -9 $alive 2>/dev/null
exit 1
