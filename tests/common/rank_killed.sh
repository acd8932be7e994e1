#!/usr/bin/env bash
# One rank killed mid-run (SIGKILL: no handler, no message of its own) ends the whole job within a
# few seconds with a message naming that rank and a non-zero exit, and no rank is left running, on
# either backend; the checkpoint saved before stays whole and resumable.
#   rank_killed.sh <fivefold> <mpi|gloo>
set -u
program=$1
backend=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
FIVEFOLD_BACKEND=$backend mpirun --oversubscribe -np 4 "$program" train --out "$work/run" \
  --tp 2 --steps 1000000 --d-model 32 --n-layers 2 --n-heads 4 --d-ff 64 --seq 16 --batch 4 \
  --synthetic-examples 300 --peak-gflops 100 --no-progress --exact-match 0 --eval-every 0 \
  --save-every 2 >"$work/log" 2>&1 &
launcher=$!
for _ in $(seq 1 600); do  # until a checkpoint exists and training goes on
  [ -e "$work/run/latest" ] && [ "$(wc -l <"$work/run/metrics.jsonl")" -ge 4 ] && break
  sleep 0.1
done
victim=""
for pid in $(pgrep -P "$launcher"); do  # the process of world rank 2
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=2" && victim=$pid
done
if [ -z "$victim" ] || [ ! -e "$work/run/latest" ]; then
  cat "$work/log"
  echo "FAIL: the job did not start training and checkpointing"
  kill -9 "$launcher" $(pgrep -P "$launcher") 2>/dev/null
  exit 1
fi
ranks=$(pgrep -P "$launcher" | tr '\n' ' ')
kill -9 "$victim"
start=$SECONDS
for _ in $(seq 1 300); do  # up to 30 s
  kill -0 "$launcher" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$launcher" 2>/dev/null; then
  echo "FAIL: mpirun still running 30 s after rank 2 was killed ($backend)"
  kill -9 "$launcher" $ranks 2>/dev/null
  exit 1
fi
wait "$launcher"
status=$?
elapsed=$((SECONDS - start))
for _ in $(seq 1 50); do  # the other ranks end within 5 s of mpirun
  alive=""
  for r in $ranks; do kill -0 "$r" 2>/dev/null && alive="$alive $r"; done
  [ -z "$alive" ] && break
  sleep 0.1
done
if [ -n "$alive" ]; then
  echo "FAIL: rank processes$alive outlived the job by 5 s ($backend)"
  kill -9 $alive 2>/dev/null
  exit 1
fi
[ "$status" -ne 0 ] || { cat "$work/log"; echo "FAIL: the job exited 0 after losing a rank"; exit 1; }
grep -Eq "rank 2 .*(exited on signal 9|Killed)" "$work/log" || {
  cat "$work/log"
  echo "FAIL: no message names rank 2 and its signal"
  exit 1
}
# The last checkpoint is a whole one: a run resumes from it on one process.
saved=$(cat "$work/run/latest")
"$program" train --out "$work/run" --resume --steps "$(( $(echo "$saved" | tr -dc 0-9 | sed 's/^0*//') + 1 ))" \
  --peak-gflops 100 --no-progress >"$work/resume.log" 2>&1 || {
  cat "$work/resume.log"
  echo "FAIL: the run does not resume from its last checkpoint after the crash"
  exit 1
}
echo "rank 2 killed: job ended in ${elapsed} s with status $status ($backend); resumed on one process from $saved"
grep -E "rank 2 .*(signal|Killed)" "$work/log" | head -2
