#!/usr/bin/env bash
# An error on one rank, or on rank 0's file system, ends the whole job within seconds, printed
# once with the rank and host that raised it, never waiting for the communicator timeout (600 s by
# default; none is set here). Then SIGTERM to the launcher: every rank says so and ends, the lock
# is released, settings.toml was written at the start, and --resume finishes the run.
#   one_rank_fails.sh <fivefold> <mpi|gloo>
# Before the fix (2026-12-04/05) the first case hung until the communicator timeout (MPI, as the
# issue that reported it measured) or ended ranks 2 and 3 with "terminate called after throwing
# gloo::IoException" and left the rendezvous file (Gloo, seen here).
set -u
program=$1
backend=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export FIVEFOLD_BACKEND=$backend
export TMPDIR=$work/tmp  # Gloo's rendezvous files under mpirun: none may outlive its job
mkdir -p "$TMPDIR"
small=(--d-model 32 --n-layers 2 --n-heads 4 --d-ff 64 --seq 16 --batch 4 --synthetic-examples 300
       --peak-gflops 100 --no-progress --exact-match 0 --eval-every 0 --eval-batches 1)
fail() {
  cat "$work/log"
  echo "FAIL ($backend): $*"
  exit 1
}

# Whether the job in $work/log failed on Gloo's TCP transport alone: connections closed, and every
# error line the echo of another rank's end (the start-up flake cmake/retry-gloo-transport.cmake
# describes, seen when other tests load the machine), not an error of ours.
transport_flake() {
  [ "$backend" = gloo ] && grep -q "Connection closed by peer" "$work/log" &&
    ! grep -E "(error|fatal): " "$work/log" | grep -vq "another rank ended"
}

# Runs `timeout 60 mpirun -np N fivefold train ARGS` into $work/log; sets status and elapsed. A
# transport flake is run once more, saying so.
job() {
  local np=$1
  shift
  local start=$SECONDS
  for attempt in 1 2; do
    timeout -s KILL 60 mpirun --oversubscribe -np "$np" "$program" train "$@" >"$work/log" 2>&1
    status=$?
    [ "$attempt" = 1 ] && transport_flake || break
    cat "$work/log"
    echo "RETRY: the run above failed on Gloo's TCP transport; running it once more"
  done
  elapsed=$((SECONDS - start))
  [ "$status" -ne 137 ] || fail "still running after 60 s: the job hung"
  ! ls "$TMPDIR"/fivefold-rendezvous-* >/dev/null 2>&1 || fail "the job left its rendezvous file"
}

# Starts `mpirun -np N fivefold train ARGS` in the background into $work/log; sets launcher.
start() {
  local np=$1
  shift
  mpirun --oversubscribe -np "$np" "$program" train "$@" >"$work/log" 2>&1 &
  launcher=$!
}

# Waits up to `seconds` for the launcher; fails if it is still running. Sets status.
finish() {
  local seconds=$1
  for _ in $(seq 1 $((seconds * 10))); do
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$launcher" 2>/dev/null; then
    kill -9 "$launcher" $(pgrep -P "$launcher") 2>/dev/null
    fail "mpirun still running ${seconds} s later: the job hung"
  fi
  wait "$launcher"
  status=$?
}

# Starts `np` ranks training into folder $2 (then ARGS) and waits until it has a checkpoint and 3
# training rows. A Gloo job whose start failed on the transport ("Connection closed by peer" on
# every rank before any error of ours: the flake cmake/retry-gloo-transport.cmake describes) is
# started once more, saying so.
start_training() {
  local np=$1 out=$2
  shift 2
  for attempt in 1 2; do
    start "$np" --out "$out" "$@"
    for _ in $(seq 1 600); do
      [ -e "$out/latest" ] && [ "$(wc -l <"$out/metrics.jsonl")" -ge 3 ] && return 0
      kill -0 "$launcher" 2>/dev/null || break
      sleep 0.1
    done
    if [ "$attempt" = 1 ] && ! kill -0 "$launcher" 2>/dev/null && transport_flake; then
      cat "$work/log"
      echo "RETRY: the start above failed on Gloo's TCP transport; starting once more"
      rm -rf "$out"
      continue
    fi
    break
  done
  fail "the job did not start training and checkpointing"
}

# 1. A checkpoint write fails on rank 0 alone mid-run (a folder stands where it writes `latest`'s
#    temporary file, as a full disk would fail it), while ranks 1-3 train on.
start_training 4 "$work/midrun" --tp 2 --steps 100000 --save-every 2 "${small[@]}"
rank0=""
for pid in $(pgrep -P "$launcher"); do
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=0" && rank0=$pid
done
[ -n "$rank0" ] || fail "rank 0's process not found"
good=$(cat "$work/midrun/latest")
# Rank 0 may be writing that very file now (write, fsync, rename): then mkdir fails with "Not a
# directory", no fault is planted and the healthy job would run on (CI, 2026-12-05). Try again
# until the rename has moved it.
planted=0
for _ in $(seq 1 100); do
  mkdir -p "$work/midrun/latest.tmp.$rank0/blocked" 2>/dev/null && planted=1 && break
  sleep 0.05
done
[ "$planted" = 1 ] || fail "could not plant the folder latest.tmp.$rank0 in 5 s"
begin=$SECONDS
finish 30
elapsed=$((SECONDS - begin))
[ "$status" -ne 0 ] || fail "the job exited 0 though rank 0 could not save"
said=$(grep -c "\[rank 0 on $(hostname)\] fivefold train: error: cannot write '.*latest'" "$work/log")
[ "$said" -eq 1 ] || fail "rank 0's error was printed $said times, not once"
! grep -q "terminate called" "$work/log" || fail "a rank ended by std::terminate"
[ -e "$work/midrun/$(cat "$work/midrun/latest")/model.safetensors" ] ||
  fail "latest ($(cat "$work/midrun/latest"), was $good) names no checkpoint"
[ ! -e "$work/midrun/.lock" ] || fail "the failed run left its lock behind"
echo "ok: rank 0's failed save ended the 4-rank job within ${elapsed} s, printed once"

# 1b. Rank 0 cannot open its metrics file (a folder in its place): found before the first step,
#     agreed, refused on every rank.
mkdir -p "$work/metrics/metrics.jsonl"
job 4 --out "$work/metrics" --tp 2 --steps 50 "${small[@]}"
[ "$status" -ne 0 ] && [ "$(grep -c "error: cannot write '.*metrics.jsonl'" "$work/log")" -eq 4 ] ||
  fail "an unwritable metrics file was not refused on every rank"
echo "ok: an unwritable metrics file refused on all 4 ranks in ${elapsed} s"

# 2. --out is a file, and 3. a live run's lock (pid 1 runs on this host): rank 0 finds out, every
#    rank refuses together before the first step.
echo "not a folder" >"$work/file"
job 2 --out "$work/file" --steps 2 "${small[@]}"
[ "$status" -ne 0 ] && [ "$(grep -c "is a file, not a folder" "$work/log")" -eq 2 ] ||
  fail "--out naming a file was not refused on both ranks"
mkdir -p "$work/locked" && echo "1 $(hostname)" >"$work/locked/.lock"
job 2 --out "$work/locked" --steps 2 "${small[@]}"
[ "$status" -ne 0 ] && [ "$(grep -c "is in use by process 1 on" "$work/log")" -eq 2 ] ||
  fail "a live lock was not refused on both ranks"
[ "$(cat "$work/locked/.lock")" = "1 $(hostname)" ] || fail "the refused run touched the lock"
job 2 --out /proc/fivefold-nope/run --steps 2 "${small[@]}"
[ "$status" -ne 0 ] && [ "$(grep -c "cannot make the output folder '/proc/fivefold-nope/run'" "$work/log")" -eq 2 ] ||
  fail "an output folder that cannot be made was not refused on both ranks"
echo "ok: a file as --out, a live lock and an unmakeable folder refused on every rank"

# 3b. Two 2-rank jobs started together into one folder: one trains, the other is refused on both
#     of its ranks within seconds (it printed its layout, then hung until killed, 2026-12-04).
# (Each with a session folder of its own: two mpiruns starting at once in one can collide,
# open-mpi/ompi#8510.)
# A Gloo job whose start failed on the transport (the flake transport_flake describes) is run
# once more, both jobs, saying so.
for attempt in 1 2; do
  rm -rf "$work/shared"
  OMPI_MCA_orte_tmpdir_base=$work/first mpirun --oversubscribe -np 2 "$program" train \
    --out "$work/shared" --steps 30 "${small[@]}" >"$work/first.log" 2>&1 &
  first=$!
  OMPI_MCA_orte_tmpdir_base=$work/second mpirun --oversubscribe -np 2 "$program" train \
    --out "$work/shared" --steps 30 "${small[@]}" >"$work/second.log" 2>&1 &
  launcher=$!
  finish 60
  second=$status
  launcher=$first
  finish 60
  cat "$work/first.log" "$work/second.log" >"$work/log"
  statuses=$(printf '%s\n' "$status" "$second" | sort | tr '\n' ' ')
  said=$(grep -cE "is in use by process [0-9]+ on |already holds a training run" "$work/log")
  [ "$attempt" = 1 ] && { [ "$statuses" != "0 1 " ] || [ "$said" -ne 2 ]; } && transport_flake ||
    break
  cat "$work/log"
  echo "RETRY: the jobs above failed on Gloo's TCP transport; running both once more"
done
[ "$statuses" = "0 1 " ] || fail "two jobs into one folder exited $statuses, not one 0 and one 1"
[ "$said" -eq 2 ] || fail "the refused job did not say why on both ranks"
echo "ok: of two jobs started together into one folder, one trained and one was refused"

# 4. SIGTERM to mpirun mid-run (as a scheduler ending a job sends it).
start_training 2 "$work/stopped" --steps 100000 --save-every 2 "${small[@]}"
[ -e "$work/stopped/settings.toml" ] || fail "settings.toml is not written at the start"
kill -TERM "$launcher"
finish 30
[ "$status" -ne 0 ] || fail "the stopped job exited 0"
! ls "$TMPDIR"/fivefold-rendezvous-* >/dev/null 2>&1 || fail "the job left its rendezvous file"
grep -q "ended by SIGTERM" "$work/log" || fail "no rank said it was ended by SIGTERM"
[ ! -e "$work/stopped/.lock" ] || fail "the stopped run left its lock behind"
latest=$(cat "$work/stopped/latest")
next=$((10#${latest#step-} + 2))
job 2 --out "$work/stopped" --resume --steps "$next" --no-progress
[ "$status" -eq 0 ] || fail "--resume after SIGTERM failed"
echo "ok: SIGTERM ended both ranks and released the lock; resumed from $latest to step $next"

# 5. SIGINT (Ctrl-C) to a run on one process: it says so, exits 130 and releases the lock.
"$program" train --out "$work/interrupted" --steps 100000 --save-every 2 "${small[@]}" \
  >"$work/log" 2>&1 &
launcher=$!
for _ in $(seq 1 600); do
  [ -e "$work/interrupted/latest" ] && break
  sleep 0.1
done
kill -INT "$launcher"
finish 30
[ "$status" -eq 130 ] && grep -q "ended by SIGINT" "$work/log" && [ ! -e "$work/interrupted/.lock" ] ||
  fail "SIGINT: exit $status, or no message, or the lock left behind"
echo "ok: SIGINT ended the run with 130 and released the lock"
