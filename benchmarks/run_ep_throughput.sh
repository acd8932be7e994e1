#!/usr/bin/env bash
# Chapter 13: ep 1 (one process, 2 threads, every expert), then ep 2 and ep 4 (1 thread per rank)
# on the same model and batches; waiting MPI threads yield their core.
# Usage: run_ep_throughput.sh [build] [flags...]
set -euo pipefail
build=${1:-build}
shift || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OMP_NUM_THREADS=2 "$build/bin/bench_ep_throughput" "$@"
for n in 2 4; do
  mpirun --oversubscribe --mca mpi_yield_when_idle 1 -np "$n" -x OMP_WAIT_POLICY=passive \
    -x OMP_NUM_THREADS=1 \
    "$build/bin/bench_ep_throughput" "$@"
done
