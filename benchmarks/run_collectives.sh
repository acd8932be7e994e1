#!/usr/bin/env bash
# Chapter 08: ring collectives from send/recv vs the backend's, at 2, 4 and 8 ranks, MPI and Gloo.
# Usage: benchmarks/run_collectives.sh [build dir] [extra args for bench_collectives]
set -euo pipefail
build=${1:-build}
shift || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
header=--header
for backend in mpi gloo; do
  for ranks in 2 4 8; do
    FIVEFOLD_BACKEND=$backend mpirun --oversubscribe --mca mpi_yield_when_idle 1 -np "$ranks" \
      "$build/bin/bench_collectives" $header "$@"
    header=
  done
done
