#!/usr/bin/env bash
# Chapter 11: every pipeline schedule on one process (the reference: no pipeline), then over 2
# and 4 ranks, on the same model and batch. Usage: run_pp_schedules.sh [build] [flags...]
set -euo pipefail
build=${1:-build}
shift || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OMP_NUM_THREADS=1 "$build/bin/bench_pp_schedules" "$@"
for np in 2 4; do
  mpirun --oversubscribe -np $np -x OMP_WAIT_POLICY=passive -x OMP_NUM_THREADS=1 \
    "$build/bin/bench_pp_schedules" "$@"
done
