#!/usr/bin/env bash
# All-reduce and send/recv latency/bandwidth at 2, 4, 8 and 16 ranks on both backends.
# Usage: benchmarks/run_comm_latency.sh [build dir] [extra args for bench_comm_latency]
set -euo pipefail
build=${1:-build}
shift || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
header=--header
for backend in mpi gloo; do
  for ranks in 2 4 8 16; do
    FIVEFOLD_BACKEND=$backend mpirun --oversubscribe --mca mpi_yield_when_idle 1 -np "$ranks" \
      "$build/bin/bench_comm_latency" $header "$@"
    header=
  done
done
