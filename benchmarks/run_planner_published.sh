#!/usr/bin/env bash
# The planner (chapter 15, `fivefold plan --search`) against published trainings, on the cluster
# presets (datasheet figures): for each, the published layout priced (its sizes, and the schedule,
# virtual stages, micro-batches and recomputation where the paper gives them, fixed; the rest as
# the planner chooses), and the best of every layout the trainer accepts. Prints a Markdown table: the
# published MFU, the published layout's predicted MFU and its difference, whether it is among the
# planner's top 5, and the planner's best. 8-10 minutes on the 2-core development machine
# (DeepSeek-V3's search is 3 of them).
#   benchmarks/run_planner_published.sh [BUILD (build)]
set -euo pipefail
cd "$(dirname "$0")/.."
ff=${1:-build}/bin/fivefold
presets=chapters/15_trainer_5d/presets/clusters
llama405b=(--d-model 16384 --n-layers 126 --n-heads 128 --n-kv-heads 8 --d-ff 53248 --vocab 128256)
# Megatron-LM's 1T GPT (Narayanan et al. 2021) as a Llama-shaped stand-in: d_ff 68,266 gives its
# 4d GELU MLP's products.
megatron1t=(--d-model 25600 --n-layers 128 --n-heads 160 --n-kv-heads 160 --d-ff 68266 --vocab 51200)
deepseek=(--config tests/07_moe/configs/deepseek-v3.json)

# name | published MFU (the model's FLOPs: Megatron's 52% counts the recomputed forward too, 39%
# without it) | cluster | devices | seq | batch | model | published layout
trainings=(
  "Llama 3 405B, 16,384 H100, 8K|0.41|h100-sxm|16384|8192|2048|llama405b|--tp 8 --pp 16 --dp 128 --schedule interleaved --virtual-stages 4 --micro-batches 16"
  "Llama 3 405B, 8,192 H100, 8K|0.43|h100-sxm|8192|8192|2048|llama405b|--tp 8 --pp 16 --dp 64 --schedule interleaved --virtual-stages 4 --micro-batches 32"
  "Llama 3 405B, 16,384 H100, 128K|0.38|h100-sxm|16384|131072|128|llama405b|--tp 8 --cp 16 --pp 16 --dp 8 --schedule interleaved --virtual-stages 4 --micro-batches 16"
  "Megatron 1T, 3,072 A100, 2K|0.39|a100-80gb|3072|2048|3072|megatron1t|--tp 8 --pp 64 --dp 6 --recompute full"
  "DeepSeek-V3, 2,048 H800, 4K|0.39|h800|2048|4096|15360|deepseek|--tp 1 --cp 1 --pp 16 --dp 128 --ep 64 --zero 1")
summary() {  # a plan's JSON -> "MFU|step s|layout, m, recompute|memory GB"
  python3 -c "
import json, sys
b = json.load(open(sys.argv[1]))['best'][0]
gb = (b['state_bytes'] + b['activation_bytes']) / 1e9
print(f\"{b['mfu']:.3f}|{b['step_s']:.2f}|{b['layout']}, m {b['micro_batches']}, recompute {b['recompute']}|{gb:.0f}\")" "$1"
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "| training | published MFU | published layout, priced | difference | in the top 5 | the planner's best |"
echo "|---|---:|---|---:|---|---|"
for spec in "${trainings[@]}"; do
  IFS='|' read -r name published cluster devices seq batch model pins <<<"$spec"
  declare -n args=$model
  common=(plan --search --cluster "$presets/$cluster.toml" --devices "$devices" "${args[@]}"
          --seq "$seq" --batch "$batch" --precision bf16 --no-progress --json)
  read -r -a pinned <<<"$pins"
  "$ff" "${common[@]}" "${pinned[@]}" --top 1 >"$work/pinned.json"
  "$ff" "${common[@]}" --top 5 >"$work/best.json"
  IFS='|' read -r mfu step layout memory <<<"$(summary "$work/pinned.json")"
  IFS='|' read -r best_mfu best_step best_layout best_memory <<<"$(summary "$work/best.json")"
  top5=$(python3 -c "
import json, sys
pinned = json.load(open(sys.argv[1]))['best'][0]
key = lambda b: (b['layout'], b['micro_batches'], b['recompute'])
print('yes' if any(key(b) == key(pinned) for b in json.load(open(sys.argv[2]))['best']) else 'no')" \
    "$work/pinned.json" "$work/best.json")
  python3 -c "
import sys
name, published, mfu, layout, memory, top5, best_mfu, best_layout = sys.argv[1:9]
p, m = float(published), float(mfu)
print(f'| {name} | {100 * p:.0f}% | {100 * m:.1f}% ({layout}, {memory} GB) | {100 * (m - p) / p:+.0f}% '
      f'| {top5} | {100 * float(best_mfu):.1f}%: {best_layout} |')" \
    "$name" "$published" "$mfu" "$layout" "$memory" "$top5" "$best_mfu" "$best_layout"
done
