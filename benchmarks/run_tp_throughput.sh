#!/usr/bin/env bash
# Chapter 10: one process with 2 threads against 2 tensor-parallel ranks with 1 thread each, on the
# same model and batch. Usage: run_tp_throughput.sh [build] [flags...]
set -euo pipefail
build=${1:-build}
shift || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OMP_NUM_THREADS=2 "$build/bin/bench_tp_throughput" "$@"
mpirun --oversubscribe -np 2 -x OMP_WAIT_POLICY=passive -x OMP_NUM_THREADS=1 \
  "$build/bin/bench_tp_throughput" "$@"
