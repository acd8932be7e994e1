#!/usr/bin/env bash
# Sets up the machine, builds, and runs the main job: chapter 15's 5D run. DeepSeek-V3 in
# miniature (MLA + experts) trains on the built-in corpus on 16 processes under mpirun, dp 2 x
# tp 2 x pp 2 x cp 2 with the experts over ep 2 (chapters/15_trainer_5d/presets/main.toml); then
# the same settings train on one process, and the two loss curves are compared: a table, the
# largest difference, and an SVG plot (runs/main/curves.svg). Extra arguments go to both runs
# (e.g. --steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset default
cmake --build --preset default --target fivefold
export OMP_WAIT_POLICY=passive  # 16 processes share the cores: idle threads must sleep
preset=chapters/15_trainer_5d/presets/main.toml
mkdir -p runs/main
rm -rf runs/main/5d runs/main/single  # this script's own runs, from an earlier time
mpi_flags=(--oversubscribe)
[ "$(id -u)" -eq 0 ] && mpi_flags+=(--allow-run-as-root)

echo "== 1/3: the 5D run on 16 processes"
start=$(date +%s)
mpirun "${mpi_flags[@]}" -np 16 build/bin/fivefold train --config "$preset" --out runs/main/5d "$@"
echo "   $(($(date +%s) - start)) s"

echo "== 2/3: the same settings on one process"
start=$(date +%s)
build/bin/fivefold train --config "$preset" --out runs/main/single --tp 1 --pp 1 --cp 1 --ep 1 \
  --zero 0 --sequence-parallel=false "$@"
echo "   $(($(date +%s) - start)) s"

echo "== 3/3: the two curves"
# The layouts add the same numbers in different orders, so the curves agree to float rounding at
# first; once a router's near-tie flips one token's expert (a discrete choice, at a step that
# depends on the machine's BLAS) they part by more, and training noise takes over. The check is on
# the first 5 steps; the table and plot show the whole run.
build/bin/fivefold compare --runs runs/main/5d,runs/main/single --labels "5D,1 process" \
  --svg runs/main/curves.svg --rows 8 --tolerance 1e-4 --check-steps 5 | tee runs/main/comparison.md
