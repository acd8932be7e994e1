#!/usr/bin/env bash
# Sets up the machine, builds, and runs the main job: for now the most advanced chapter demo
# (chapter 02: the FLOPs of a training step, measured and derived, and its MFU). When the 5D
# trainer exists this becomes `mpirun ... fivefold train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset default
cmake --build --preset default --target ch02_flops_6np_demo fivefold
build/bin/ch02_flops_6np_demo "$@"
