#!/usr/bin/env bash
# A learner's loop for each chapter's exercise, timed on an existing build tree: the file the
# learner edits changes (here its reference solution gets a new comment line and the loop's build
# runs with CCACHE_DISABLE=1, so the file really recompiles as an edited one would; the loop ends
# green: the longest case, every test running to the end; the file is restored afterwards), the
# loop's build target, then its tests:
#   cmake --build build --target loop_chNN && ctest --test-dir build -L loop_chNN   (2 jobs)
# (the tests that check the exercise directly; fivefold_test's LOOP option). With --whole, also
# the chapter's whole suite once the loop is green: the rest of the build, then `ctest -L chNN`.
# Prints a Markdown table: chapter, the exercise's files, seconds to rebuild, seconds of tests,
# the loop's total, its verdict (and, with --whole, the whole suite's seconds and verdict).
#   scripts/exercise-loops.sh [--whole] [BUILD_PRESET (default)] [CHAPTER ...]
set -euo pipefail
cd "$(dirname "$0")/.."
whole=0
if [ "${1:-}" = --whole ]; then whole=1; shift; fi
preset=${1:-default}
shift || true
chapters=("$@")
if [ ${#chapters[@]} -eq 0 ]; then
  for dir in exercises/[0-9][0-9]_*/; do chapters+=("$(basename "$dir")"); done
fi
export OMP_WAIT_POLICY=passive OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake --build --preset "$preset" >/dev/null  # start from an up-to-date tree

# verdict LABEL: runs `ctest -L LABEL` (2 jobs) and prints "N passed" or "FAILED: F of N".
verdict() {
  if ctest --preset "$preset" -L "$1" -j2 >/tmp/exercise-loop.log 2>&1; then
    sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2 passed/p' /tmp/exercise-loop.log
  else
    sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/FAILED: \1 of \2/p' /tmp/exercise-loop.log
  fi
}

header="| chapter | exercise | rebuild (s) | \`ctest -L loop_chNN\` (s) | loop (s) | tests |"
rule="|---|---|---:|---:|---:|---|"
if [ $whole -eq 1 ]; then
  header+=" then the whole chapter: build + \`ctest -L chNN\` (s) | tests |"
  rule+="---:|---|"
fi
echo "$header"
echo "$rule"
for chapter in "${chapters[@]}"; do
  label="ch${chapter:0:2}"
  files=()
  edited=()
  for f in exercises/"$chapter"/*.cpp; do
    files+=("$(basename "$f")")
    edited+=("solutions/$chapter/$(basename "$f")")
  done
  for f in "${edited[@]}"; do cp "$f" "$f.loop-backup"; echo "// edited at $(date +%s.%N)" >>"$f"; done
  trap 'for f in "${edited[@]}"; do mv "$f.loop-backup" "$f"; done' EXIT
  start=$(date +%s.%N)
  CCACHE_DISABLE=1 cmake --build --preset "$preset" --target "loop_$label" >/dev/null
  built=$(date +%s.%N)
  loop_verdict=$(verdict "loop_$label")
  done_at=$(date +%s.%N)
  row=$(awk -v c="$chapter" -v f="${files[*]}" -v s="$start" -v b="$built" -v d="$done_at" \
    -v v="$loop_verdict" 'BEGIN { printf "| %s | %s | %.0f | %.0f | %.0f | %s |", c, f, b - s, d - b, d - s, v }')
  if [ $whole -eq 1 ]; then
    cmake --build --preset "$preset" >/dev/null
    whole_verdict=$(verdict "$label")
    row+=$(awk -v s="$done_at" -v d="$(date +%s.%N)" -v v="$whole_verdict" \
      'BEGIN { printf " %.0f | %s |", d - s, v }')
  fi
  echo "$row"
  for f in "${edited[@]}"; do mv "$f.loop-backup" "$f"; done
  trap - EXIT
done
cmake --build --preset "$preset" >/dev/null  # the restored files: the tree as it was
