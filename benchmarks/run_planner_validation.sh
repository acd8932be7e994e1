#!/usr/bin/env bash
# The planner (chapter 15, `fivefold plan --search`) against runs measured here: calibrates this
# machine on 2 ranks (`fivefold calibrate`: a device is one of its 2 cores) and on 4 (two ranks a
# core: the calibration runs every rank at once, so the rates it measures are what each rank of
# an oversubscribed job gets), then for each of 12 layouts of 2 devices and 7 of 4 asks the
# planner for its step time (the sizes, ZeRO stage, schedule, virtual stages and micro-batches
# fixed; sequence parallelism, cp's kernel and recomputation as the planner chooses them), trains
# that layout 7 steps and takes the median step time of steps 2-7 from metrics.jsonl. Prints a
# Markdown table, the median absolute error, and for each number of devices whether the layout
# the planner ranks first is the fastest measured.
#   benchmarks/run_planner_validation.sh [BUILD (build)] [WORK (build/planner-validation)]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
work=${2:-$build/planner-validation}
ff=$build/bin/fivefold
export OMP_WAIT_POLICY=passive OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
mpirun=(mpirun --oversubscribe --mca mpi_yield_when_idle 1)
model=(--d-model 256 --n-layers 4 --n-heads 8 --n-kv-heads 8 --d-ff 704 --seq 256 --batch 8)
rm -rf "$work" && mkdir -p "$work"
for np in 2 4; do
  "${mpirun[@]}" -np "$np" "$ff" calibrate --cluster-out "$work/this-machine-$np.toml" \
    "${model[@]}" 2>&1 | grep wrote
done

# name | ranks | dp tp pp cp | zero | schedule | v | m
layouts=(
  "dp 2|2|2 1 1 1|0|1f1b|1|1" "dp 2, ZeRO-1|2|2 1 1 1|1|1f1b|1|1"
  "dp 2, ZeRO-2|2|2 1 1 1|2|1f1b|1|1" "dp 2, ZeRO-3|2|2 1 1 1|3|1f1b|1|1"
  "dp 2, ZeRO-1, 2 micro-batches|2|2 1 1 1|1|1f1b|1|2"
  "dp 2, ZeRO-3, 2 micro-batches|2|2 1 1 1|3|1f1b|1|2" "tp 2|2|1 2 1 1|0|1f1b|1|1"
  "pp 2, gpipe|2|1 1 2 1|0|gpipe|1|4" "pp 2, 1f1b|2|1 1 2 1|0|1f1b|1|4"
  "pp 2, zb|2|1 1 2 1|0|zb|1|4" "pp 2, interleaved v 2|2|1 1 2 1|0|interleaved|2|4"
  "cp 2|2|1 1 1 2|0|1f1b|1|1"
  "dp 4|4|4 1 1 1|0|1f1b|1|1" "dp 4, ZeRO-1|4|4 1 1 1|1|1f1b|1|1" "dp 2 x tp 2|4|2 2 1 1|0|1f1b|1|1"
  "dp 2 x pp 2, 1f1b, 4|4|2 1 2 1|0|1f1b|1|4" "tp 2 x pp 2, zb, 4|4|1 2 2 1|0|zb|1|4"
  "pp 4, 1f1b, 8|4|1 1 4 1|0|1f1b|1|8" "dp 2 x cp 2|4|2 1 1 2|0|1f1b|1|1")
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['best'][0][sys.argv[2]])" "$@"; }
echo
echo "| layout | planner's choices | measured s | predicted s | error |"
echo "|---|---|---:|---:|---:|"
rows=$work/rows.txt
: >"$rows"
i=0
for spec in "${layouts[@]}"; do
  IFS='|' read -r name np sizes zero schedule v m <<<"$spec"
  read -r dp tp pp cp <<<"$sizes"
  plan=$work/plan-$i.json
  "$ff" plan --search --cluster "$work/this-machine-$np.toml" --devices "$np" "${model[@]}" \
    --vocab 259 --dp "$dp" --tp "$tp" --pp "$pp" --cp "$cp" --zero "$zero" --schedule "$schedule" \
    --virtual-stages "$v" --micro-batches "$m" --top 1 --no-progress --json >"$plan"
  predicted=$(field "$plan" step_s)
  flags=(--dp "$dp" --tp "$tp" --pp "$pp" --cp "$cp" --zero "$zero" --accum "$m"
         --recompute "$(field "$plan" recompute)")
  [ "$pp" -gt 1 ] && flags+=(--schedule "$schedule" --virtual-stages "$v")
  [ "$(field "$plan" sequence_parallel)" = True ] && flags+=(--sequence-parallel)
  choices="recompute $(field "$plan" recompute)"
  [ "$tp" -gt 1 ] && choices+=", SP $(field "$plan" sequence_parallel)"
  if [ "$cp" -gt 1 ]; then
    kernel=$(python3 -c "import json,sys; l=json.load(open(sys.argv[1]))['best'][0]['layout']; print('allgather' if 'allgather' in l else 'ring')" "$plan")
    flags+=(--cp-attention "$kernel"); choices+=", $kernel"
  fi
  run=(--out "$work/run-$i" "${model[@]}" --steps 7 --eval-every 0 --save-every 0 --exact-match 0
       --warmup 1 --no-progress "${flags[@]}")
  if [ "$np" -eq 1 ]; then FIVEFOLD_THREADS=1 "$ff" train "${run[@]}" >/dev/null 2>&1
  else "${mpirun[@]}" -np "$np" "$ff" train "${run[@]}" >/dev/null 2>&1; fi
  measured=$(python3 -c "
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"step_time_s\"' in l]
print(statistics.median(r['step_time_s'] for r in rows[1:]))" "$work/run-$i/metrics.jsonl")
  python3 -c "
import sys; n, c, m, p = sys.argv[1:5]; m, p = float(m), float(p)
print(f'| {n} | {c} | {m:.3f} | {p:.3f} | {100 * (p - m) / m:+.0f}% |')" "$name" "$choices" \
    "$measured" "$predicted"
  echo "$name|$measured|$predicted|$np" >>"$rows"
  i=$((i + 1))
done
python3 - "$rows" <<'PY'
import statistics, sys
rows = [line.strip().split('|') for line in open(sys.argv[1])]
errors = [abs(float(p) - float(m)) / float(m) for _, m, p, _ in rows]
print(f"\nmedian absolute error {100 * statistics.median(errors):.1f}% over {len(rows)} layouts")
for np in sorted({r[3] for r in rows}):
    of = [r for r in rows if r[3] == np]
    best_predicted = min(of, key=lambda r: float(r[2]))
    best_measured = min(of, key=lambda r: float(r[1]))
    gap = float(best_predicted[1]) / float(best_measured[1]) - 1
    print(f"{np} devices: the planner ranks '{best_predicted[0]}' first; the fastest measured is "
          f"'{best_measured[0]}'; the planner's first is {100 * gap:.1f}% slower than it")
PY
