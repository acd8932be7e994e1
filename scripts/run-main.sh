#!/usr/bin/env bash
# Sets up the machine, builds, and runs the main job: for now the most advanced chapter demo
# (chapter 05: pass-key retrieval beyond the training length with PI, NTK, YaRN). When the 5D
# trainer exists this becomes `mpirun ... fivefold train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset default
cmake --build --preset default --target ch05_yarn_demo fivefold
build/bin/ch05_yarn_demo "$@"
