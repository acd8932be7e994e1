#!/usr/bin/env bash
# Code lines of each chapter's reference code (its headers in chapters/NN_topic/ and its
# solutions/NN_topic/ files; demos, tests and exercises not counted) and of runtime/ and
# programs/: lines that are neither blank nor only a comment (// ..., /// ..., or inside /* */).
#
#   bash scripts/code-lines.sh          # a Markdown table: place, code lines, largest file
set -euo pipefail
cd "$(dirname "$0")/.."

count() {  # code lines of the files given
  [ "$#" -eq 0 ] && { echo 0; return; }
  awk '
    { line = $0; sub(/^[ \t]+/, "", line) }
    in_block { if (line ~ /\*\//) in_block = 0; next }
    line == "" { next }
    line ~ /^\/\// { next }
    line ~ /^\/\*/ { if (line !~ /\*\//) in_block = 1; next }
    { n++ }
    END { print n + 0 }' "$@"
}

row() {  # place, then its files
  local place=$1; shift
  local total largest="" most=0 f n
  total=$(count "$@")
  for f in "$@"; do
    n=$(count "$f")
    if [ "$n" -gt "$most" ]; then most=$n; largest="$(basename "$f") $n"; fi
  done
  echo "| $place | $total | $largest |"
}

echo "| code | lines | largest file |"
echo "|---|---:|---|"
for dir in chapters/[0-9][0-9]_*/; do
  chapter=$(basename "$dir")
  shopt -s nullglob
  files=(chapters/"$chapter"/*.h solutions/"$chapter"/*.h solutions/"$chapter"/*.cpp)
  shopt -u nullglob
  row "$chapter" "${files[@]}"
done
row "runtime/" runtime/include/runtime/*.h runtime/src/*.cpp
row "programs/" programs/*.h programs/*.cpp
