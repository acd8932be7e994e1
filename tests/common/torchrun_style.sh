#!/usr/bin/env bash
# Starts N processes the way `torchrun --no-python` does (RANK, WORLD_SIZE, LOCAL_RANK,
# LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and checks that they meet through the TCPStore,
# choose the Gloo backend by themselves, and all-reduce correctly. A random port is retried if
# another process holds it.
# Usage: torchrun_style.sh <fivefold binary> [ranks]
set -u
program=$1
ranks=${2:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export FIVEFOLD_COMM_TIMEOUT=30
source "$(dirname "$0")/ports.sh"
for attempt in 1 2 3 4 5; do
  port=$(pick_port) || exit 1
  pids=()
  for ((r = 0; r < ranks; r++)); do
    env -u OMPI_COMM_WORLD_SIZE -u SLURM_PROCID -u FIVEFOLD_BACKEND \
      RANK=$r WORLD_SIZE=$ranks LOCAL_RANK=$r LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port "$program" info >"$out/rank$r" 2>&1 &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  cat "$out"/rank*
  if [ $status -eq 0 ]; then
    grep -q "launcher torchrun, backend gloo" "$out/rank0" && grep -q "(correct)" "$out/rank0" && exit 0
    echo "torchrun_style: ranks exited 0 but did not report a correct Gloo all-reduce" >&2
    exit 1
  fi
  grep -qi "in use" "$out"/rank* || exit 1   # a real failure, not a taken port
  echo "torchrun_style: port $port was taken, retrying" >&2
done
exit 1
