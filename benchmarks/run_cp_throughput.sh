#!/usr/bin/env bash
# Chapter 12: cp 1 (one process, 2 threads), then cp 2 and cp 4 (1 thread per rank) on the same
# model and sequence; waiting MPI threads yield their core (2 cores run up to 8 threads).
# Usage: run_cp_throughput.sh [build] [flags...]
set -euo pipefail
build=${1:-build}
shift || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OMP_NUM_THREADS=2 "$build/bin/bench_cp_throughput" "$@"
for n in 2 4; do
  mpirun --oversubscribe --mca mpi_yield_when_idle 1 -np "$n" -x OMP_WAIT_POLICY=passive \
    -x OMP_NUM_THREADS=1 \
    "$build/bin/bench_cp_throughput" "$@"
done
