#!/usr/bin/env bash
# A learner's loop for each chapter's exercise, timed on an existing build tree: the file the
# learner edits changes (here its reference solution is touched, so the loop ends green: the
# longest case, every test running to the end), the build, then the README's test command for the
# chapter (`ctest -L chNN`, 2 jobs). Prints a Markdown table: chapter, the exercise's files,
# seconds to rebuild, seconds of tests, the total, and the tests' verdict.
#   scripts/exercise-loops.sh [BUILD_PRESET (default)] [CHAPTER ...]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-default}
shift || true
chapters=("$@")
if [ ${#chapters[@]} -eq 0 ]; then
  for dir in exercises/[0-9][0-9]_*/; do chapters+=("$(basename "$dir")"); done
fi
export OMP_WAIT_POLICY=passive OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake --build --preset "$preset" >/dev/null  # start from an up-to-date tree

echo "| chapter | exercise | rebuild (s) | \`ctest -L chNN\` (s) | loop (s) | tests |"
echo "|---|---|---:|---:|---:|---|"
for chapter in "${chapters[@]}"; do
  label="ch${chapter:0:2}"
  files=()
  for f in exercises/"$chapter"/*.cpp; do files+=("$(basename "$f")"); touch "solutions/$chapter/$(basename "$f")"; done
  start=$(date +%s.%N)
  cmake --build --preset "$preset" >/dev/null
  built=$(date +%s.%N)
  if ctest --preset "$preset" -L "$label" -j2 >/tmp/exercise-loop.log 2>&1; then
    verdict="$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2 passed/p' /tmp/exercise-loop.log)"
  else
    verdict="FAILED: $(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\1 of \2/p' /tmp/exercise-loop.log)"
  fi
  done_at=$(date +%s.%N)
  awk -v c="$chapter" -v f="${files[*]}" -v s="$start" -v b="$built" -v d="$done_at" -v v="$verdict" \
    'BEGIN { printf "| %s | %s | %.0f | %.0f | %.0f | %s |\n", c, f, b - s, d - b, d - s, v }'
done
