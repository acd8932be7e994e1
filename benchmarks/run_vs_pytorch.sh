#!/usr/bin/env bash
# fivefold's training step against the same model in PyTorch (eager, Python), in one run:
# bench_train_throughput and benchmarks/torch_train_throughput.py alternate for ROUNDS rounds on
# the same threads, and the medians of their tokens/s per size are printed with the ratio.
# Needs Debian's python3-torch (benchmarks only: `apt-get install python3-torch`). With BF16=1 in
# the environment, each size also in bf16: fivefold's --precision bf16 against PyTorch under
# torch.autocast("cpu", torch.bfloat16), the same rounds. Under each table, the machine's matmul
# peak as fivefold's runs measured it (fp32, and bf16 with BF16=1), so that ratios from different
# days or machines can be read against the products' own speed.
#   [BF16=1] benchmarks/run_vs_pytorch.sh [build] [rounds (5)] [steps per size (10)] [threads (2)]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-5}
steps=${3:-10}
threads=${4:-2}
py=python3
[ -x /usr/bin/python3 ] && py=/usr/bin/python3  # Debian's, where python3-torch installs
"$py" -c "import torch" 2>/dev/null ||
  { echo "run_vs_pytorch: python3-torch is missing (apt-get install python3-torch)" >&2; exit 1; }
[ -x "$build/bin/bench_train_throughput" ] ||
  { echo "run_vs_pytorch: $build/bin/bench_train_throughput is missing (build first)" >&2; exit 1; }
unset OMP_WAIT_POLICY  # one process: its OpenMP threads must not sleep between operations
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bf16=()
[ "${BF16:-0}" = 1 ] && bf16=(--bf16)
for ((r = 1; r <= rounds; r++)); do
  echo "round $r/$rounds" >&2
  "$build/bin/bench_train_throughput" --steps "$steps" --threads "$threads" --json --compare \
    "${bf16[@]}" >>"$out/fivefold"
  "$py" benchmarks/torch_train_throughput.py --steps "$steps" --threads "$threads" --json \
    "${bf16[@]}" >>"$out/pytorch"
done
"$py" - "$out/fivefold" "$out/pytorch" "$threads" "$rounds" <<'EOF'
import json, statistics, sys
def load(path, key="tokens_per_s"):
    runs = {}
    for line in open(path):
        r = json.loads(line)
        runs.setdefault(r["model"], []).append(r[key])
    return runs
ours, lesson, theirs = load(sys.argv[1]), load(sys.argv[1], "lesson_tokens_per_s"), load(sys.argv[2])
print(f"tokens/s, medians of {sys.argv[4]} alternating rounds, {sys.argv[3]} threads each; "
      "fivefold with its fast paths (the trainer's default) and with --lesson-kernels\n")
print("| model | fivefold | lesson kernels | PyTorch (eager) | fivefold / PyTorch | per round, min-max "
      "| lesson / PyTorch |")
print("|---|---:|---:|---:|---:|---|---:|")
for model, mine in ours.items():
    ref, plain = theirs[model], lesson[model]
    ratios = [a / b for a, b in zip(mine, ref)]
    m, r, p = statistics.median(mine), statistics.median(ref), statistics.median(plain)
    print(f"| {model} | {m:.0f} | {p:.0f} | {r:.0f} | {m / r:.2f}x | "
          f"{min(ratios):.2f}-{max(ratios):.2f}x | {p / r:.2f}x |")
def peak(key):  # fivefold's in-run matmul peak, one figure a round: median (min-max)
    rounds = next(iter(load(sys.argv[1], key).values()))
    return (f"{statistics.median(rounds):.0f} GFLOP/s "
            f"({min(rounds):.0f}-{max(rounds):.0f} over the rounds)")
print(f"\nthe machine's matmul peak in fivefold's runs (best of 1024^3 and 2048^3 products): fp32 "
      f"{peak('peak_gflops')}")
ours_bf16, theirs_bf16 = load(sys.argv[1], "bf16_tokens_per_s"), None
try:
    theirs_bf16 = load(sys.argv[2], "bf16_tokens_per_s")
except KeyError:
    pass
if theirs_bf16 and all(v > 0 for runs in ours_bf16.values() for v in runs):
    print("\nbf16 products (fivefold --precision bf16; PyTorch under torch.autocast(bfloat16)), "
          "the same rounds:\n")
    print("| model | fivefold bf16 | x its fp32 | PyTorch autocast | x its fp32 | "
          "fivefold / PyTorch, bf16 | per round, min-max |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for model, mine in ours_bf16.items():
        ref = theirs_bf16[model]
        ratios = [a / b for a, b in zip(mine, ref)]
        m, r = statistics.median(mine), statistics.median(ref)
        print(f"| {model} | {m:.0f} | {m / statistics.median(ours[model]):.2f}x | {r:.0f} | "
              f"{r / statistics.median(theirs[model]):.2f}x | {m / r:.2f}x | "
              f"{min(ratios):.2f}-{max(ratios):.2f}x |")
    print(f"\nthe same in bf16 (chapter 14's products): {peak('bf16_peak_gflops')}")
EOF
