#!/usr/bin/env bash
# Sets up the machine, builds, and runs the main job: for now the most advanced chapter demo
# (chapter 04: the same model trained without positions and with RoPE, compared). When the 5D
# trainer exists this becomes `mpirun ... fivefold train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset default
cmake --build --preset default --target ch04_rope_demo fivefold
build/bin/ch04_rope_demo "$@"
