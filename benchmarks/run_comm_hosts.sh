#!/usr/bin/env bash
# Communication across two hosts made of network namespaces (scripts/hosts.sh: TCP over a veth
# pair and a bridge) beside one machine (MPI's shared memory; Gloo over loopback TCP):
# 1. bench_comm_latency at 2 ranks, one on each host, on both backends, and the same on one
#    machine; then the alpha-beta fit of each transport's send/recv (time = alpha + bytes / beta,
#    least squares over the message sizes);
# 2. the main preset's 16-rank 5D run, 8 ranks a host, beside the same 16 ranks on one machine:
#    median step time over STEPS steps (the first two left out).
# Both "hosts" share this machine's cores and memory: what differs is the path a message takes
# (the kernel's TCP stack and a virtual cable instead of shared memory), not a real network.
# Needs root (network namespaces).
#   benchmarks/run_comm_hosts.sh [build dir] [steps (20)]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
steps=${2:-20}
hosts=scripts/hosts.sh
"$hosts" check
name=bench
"$hosts" down "$name"
trap '"$hosts" down "$name"' EXIT
trap 'exit 130' INT TERM  # the EXIT trap removes the hosts
"$hosts" up 2 "$name" >/dev/null
export OMP_WAIT_POLICY=passive OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)

echo "## 1. Latency and bandwidth, 2 ranks"
echo
for backend in mpi gloo; do
  FIVEFOLD_BACKEND=$backend mpirun --oversubscribe -np 2 "$build/bin/bench_comm_latency" \
    --header --sizes 1,1024,16384,262144,1048576 | sed "s/^$backend /$backend-1host /" \
    >"$out/$backend-one"
  FIVEFOLD_BACKEND=$backend "$hosts" mpirun "$name" --per-host 1 -- -np 2 \
    "$build/bin/bench_comm_latency" --sizes 1,1024,16384,262144,1048576 |
    sed "s/^$backend /$backend-2hosts /" >"$out/$backend-two"
done
echo '```'
cat "$out/mpi-one" "$out/mpi-two" "$out/gloo-one" "$out/gloo-two"
echo '```'
echo
echo "| transport | send/recv alpha (us) | send/recv beta (GB/s) | all-reduce 4 MiB (us) |"
echo "|---|---:|---:|---:|"
for f in mpi-one mpi-two gloo-one gloo-two; do
  awk -v label="$f" '
    $3 == "send_recv" { x = $4; y = $5; n++; sx += x; sy += y; sxx += x * x; sxy += x * y }
    $3 == "all_reduce" && $4 == 4194304 { ar = $5 }
    END {
      slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)   # us per byte
      alpha = (sy - slope * sx) / n
      names["mpi-one"] = "MPI, one machine (shared memory)"; names["mpi-two"] = "MPI, two hosts (TCP)"
      names["gloo-one"] = "Gloo, one machine (loopback TCP)"; names["gloo-two"] = "Gloo, two hosts (TCP)"
      printf "| %s | %.1f | %.2f | %.0f |\n", names[label], alpha, 1e-3 / slope, ar
    }' "$out/$f"
done

echo
echo "## 2. The main preset's 16 ranks: step time"
echo
preset=chapters/15_trainer_5d/presets/main.toml
train=(train --config "$preset" --steps "$steps" --eval-every 0 --save-every 0 --no-progress)
mpirun --oversubscribe -np 16 "$build/bin/fivefold" "${train[@]}" --out "$out/one" >/dev/null 2>&1
"$hosts" mpirun "$name" --per-host 8 -- -np 16 "$build/bin/fivefold" "${train[@]}" \
  --out "$out/two" >/dev/null 2>&1
median() {  # median step_time_s of a run's train rows after the first two
  grep '"kind":"train"' "$1/metrics.jsonl" | sed -n 's/.*"step_time_s":\([0-9.e-]*\).*/\1/p' |
    tail -n +3 | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'
}
one=$(median "$out/one")
two=$(median "$out/two")
echo "| where | median step time (s) |"
echo "|---|---:|"
echo "| 16 ranks on one machine (MPI, shared memory) | $one |"
echo "| 8 ranks on each of 2 hosts (MPI over TCP) | $two |"
awk -v a="$one" -v b="$two" 'BEGIN { printf "\ntwo hosts / one machine: %.2fx\n", b / a }'
rm -rf "$out"
