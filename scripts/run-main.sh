#!/usr/bin/env bash
# Sets up the machine, builds, and runs the main job: for now the most advanced chapter demo
# (chapter 03: train the baseline transformer, evaluate it, generate from it). When the 5D
# trainer exists this becomes `mpirun ... fivefold train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset default
cmake --build --preset default --target ch03_transformer_demo fivefold
build/bin/ch03_transformer_demo "$@"
