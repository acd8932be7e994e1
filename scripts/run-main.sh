#!/usr/bin/env bash
# Sets up the machine, builds, and runs the main job: for now the most advanced chapter demo
# (chapter 01: activation and gradient scale with depth per initialisation scheme). When the 5D
# trainer exists this becomes `mpirun ... fivefold train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset default
cmake --build --preset default --target ch01_weight_init_demo fivefold
build/bin/ch01_weight_init_demo "$@"
