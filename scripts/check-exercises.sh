#!/usr/bin/env bash
# The other direction of the exercise switch, on an existing build tree (default: build/):
# with FIVEFOLD_EXERCISES=all everything compiles, every test labelled `exercise` fails with
# NotImplemented, and chapter tests without that label (plumbing the learner does not write) still
# pass. The tree is switched back to the solutions afterwards (CI, which throws the tree away,
# sets FIVEFOLD_KEEP_EXERCISES=1 to skip that rebuild). Only the swapped files recompile: the
# switch changes which sources a chapter uses, never the compile flags.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
export OMP_WAIT_POLICY=passive
restore() { cmake -S . -B "$build" -DFIVEFOLD_EXERCISES= >/dev/null && cmake --build "$build" >/dev/null; }
if [ -z "${FIVEFOLD_KEEP_EXERCISES:-}" ]; then trap restore EXIT; fi
cmake -S . -B "$build" -DFIVEFOLD_EXERCISES=all
cmake --build "$build"

log=$(mktemp)
total=$(ctest --test-dir "$build" -N -L exercise | sed -n 's/^Total Tests: //p')
set +e
ctest --test-dir "$build" -L exercise -j2 --output-on-failure >"$log" 2>&1
set -e
failed=$(sed -n 's/.* tests passed, \([0-9]*\) tests failed out of .*/\1/p' "$log")
not_implemented=$(grep -c "NotImplemented: ch" "$log" || true)
echo "exercise tests: $total, failed: ${failed:-0}, NotImplemented messages: $not_implemented"
if [ "$total" -eq 0 ] || [ "${failed:-0}" -ne "$total" ] || [ "$not_implemented" -eq 0 ]; then
  cat "$log"
  echo "check-exercises: every exercise test must fail with NotImplemented in exercise mode" >&2
  exit 1
fi
rm -f "$log"
# Chapter tests that do not depend on an exercise must pass in exercise mode too.
ctest --test-dir "$build" -L 'ch[0-9][0-9]' -LE exercise -j2
if [ -z "${FIVEFOLD_KEEP_EXERCISES:-}" ]; then
  echo "check-exercises: ok (switching $build back to the solutions)"
else
  echo "check-exercises: ok ($build left in exercise mode: FIVEFOLD_KEEP_EXERCISES)"
fi
