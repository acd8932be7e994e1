#!/usr/bin/env bash
# torchrun-style Gloo rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) that cannot complete
# must end every process with a message saying why, within FIVEFOLD_COMM_TIMEOUT (3 s here):
# 1. WORLD_SIZE=3 with two processes started: both say rank 2 never arrived;
# 2. a second job on the port of a running one: its rank 0 cannot serve the port, its rank 1
#    (which reaches the first job's store) says another job uses the rendezvous;
# 3. a rank whose port is held by a process that accepts but never answers (rank 0 stopped with
#    SIGSTOP once it serves): it ends on its own, saying no reply came (LibTorch's store client
#    would wait for the reply forever).
# 4. Gloo under mpirun across machines without MASTER_ADDR (OMPI's variables: 2 of 4 ranks on this
#    machine): refused at once, before any file or port is touched, with the flags that fix it
#    (a file rendezvous cannot reach another machine: each machine's ranks used to wait for the
#    timeout on a file of their own).
# Usage: rendezvous_faults.sh <fivefold binary>
set -u
program=$1
work=$(mktemp -d)
export FIVEFOLD_COMM_TIMEOUT=3
start() {  # start <rank> <world size> <port> <log> <command...>
  local rank=$1 size=$2 port=$3 log=$4
  shift 4
  env -u OMPI_COMM_WORLD_SIZE -u SLURM_PROCID -u FIVEFOLD_BACKEND RANK=$rank WORLD_SIZE=$size \
    LOCAL_RANK=$rank LOCAL_WORLD_SIZE=$size MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$program" "$@" >"$log" 2>&1 &
}
cleanup() { kill -9 $(jobs -p) 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
fail() { cat "$work"/*.log; echo "FAIL: $1"; exit 1; }

source "$(dirname "$0")/ports.sh"

# 1. A missing rank (on another port if a process beside this test took the one chosen).
for attempt in 1 2 3; do
  port=$(pick_port) || exit 1
  start 0 3 "$port" "$work/missing0.log" info
  a=$!
  start 1 3 "$port" "$work/missing1.log" info
  b=$!
  SECONDS=0
  wait "$a" && fail "rank 0 of an incomplete job exited 0"
  wait "$b" && fail "rank 1 of an incomplete job exited 0"
  [ "$SECONDS" -le 20 ] || fail "an incomplete rendezvous took ${SECONDS} s to give up"
  grep -qi "address already in use" "$work/missing0.log" || break
  echo "port $port was taken, retrying"
done
for r in 0 1; do
  grep -q "rank(s) 2 of 3 never arrived" "$work/missing$r.log" || fail "rank $r did not name rank 2"
done
echo "missing rank: both processes named rank 2 after ${SECONDS} s"

# 2. A second job on a port in use: the first job trains until it is killed at the end.
for attempt in 1 2 3; do
  port=$(pick_port) || exit 1
  train=(train --out "$work/first-$attempt" --steps 1000000 --d-model 32 --n-layers 1 --n-heads 4
         --d-ff 64 --seq 16 --batch 4 --synthetic-examples 300 --peak-gflops 100 --no-progress
         --exact-match 0 --eval-every 0 --save-every 0)
  start 0 2 "$port" "$work/first0.log" "${train[@]}"
  start 1 2 "$port" "$work/first1.log" "${train[@]}"
  for _ in $(seq 1 100); do [ -s "$work/first-$attempt/metrics.jsonl" ] && break; sleep 0.1; done
  [ -s "$work/first-$attempt/metrics.jsonl" ] && break
  # Retried: a port taken meanwhile, or Gloo's start-up transport flake (both ranks "Connection
  # closed by peer" at once; see one_rank_fails.sh).
  grep -qiE "in use|Connection closed by peer" "$work"/first*.log || fail "the first job did not start"
  kill -9 $(jobs -p) 2>/dev/null
done
start 0 2 "$port" "$work/second0.log" info
c=$!
start 1 2 "$port" "$work/second1.log" info
d=$!
SECONDS=0
wait "$c" && fail "the second job's rank 0 exited 0"
wait "$d" && fail "the second job's rank 1 exited 0"
[ "$SECONDS" -le 20 ] || fail "the second job took ${SECONDS} s to give up"
grep -qi "in use" "$work/second0.log" || fail "the second job's rank 0 did not say the port is in use"
grep -q "another job uses the same rendezvous" "$work/second1.log" ||
  fail "the second job's rank 1 did not say another job uses the rendezvous"
echo "port collision: the second job ended after ${SECONDS} s, saying why"
kill -9 $(jobs -p) 2>/dev/null
wait 2>/dev/null

# 3. A store that never answers.
port=$(pick_port) || exit 1
start 0 2 "$port" "$work/stopped0.log" info
e=$!
for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
kill -STOP "$e"
start 1 2 "$port" "$work/stopped1.log" info
f=$!
SECONDS=0
wait "$f" && fail "a rank whose store never answers exited 0"
[ "$SECONDS" -le 25 ] || fail "a rank whose store never answers took ${SECONDS} s to give up"
grep -q "no reply from the rendezvous store" "$work/stopped1.log" ||
  fail "the rank whose store never answers did not say so"
kill -9 "$e" 2>/dev/null
echo "silent store: the waiting rank ended after ${SECONDS} s, saying why"

# 4. Several machines, no MASTER_ADDR.
env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE FIVEFOLD_BACKEND=gloo \
  OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_RANK=2 OMPI_COMM_WORLD_LOCAL_RANK=0 \
  OMPI_COMM_WORLD_LOCAL_SIZE=2 OMPI_MCA_ess_base_jobid=4242 \
  timeout 20 "$program" train --out "$work/hosts-run" --steps 1 >"$work/hosts.log" 2>&1
status=$?
[ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "several machines without MASTER_ADDR: exit $status"
grep -q "spans several machines .*MASTER_ADDR=" "$work/hosts.log" ||
  fail "several machines without MASTER_ADDR: no message naming the fix"
[ ! -e "$work/hosts-run" ] || fail "several machines without MASTER_ADDR: the run folder was made"
echo "several machines, no MASTER_ADDR: refused at once, naming the fix"
exit 0
