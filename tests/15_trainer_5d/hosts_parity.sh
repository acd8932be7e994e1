#!/usr/bin/env bash
# `fivefold train` across hosts made of network namespaces (scripts/hosts.sh: each host its own
# network stack, hostname and address; the ranks talk over TCP only), against one process:
# - the reduced parity matrix, each layout's ranks split equally over the hosts (MPI: 4 hosts,
#   so its 2-, 4- and 8-rank layouts run 1, 1 and 2 ranks a host; Gloo: 2 hosts);
# - a run saved across 2 hosts resumes on this machine alone in another layout, and its whole
#   curve is the one process's;
# - (MPI) the main preset's 16-rank 5D layout, 8 ranks a host; `fivefold calibrate` over 2 hosts
#   of 2 ranks times the node's link (shared memory) and the nodes' (TCP) apart;
# - (Gloo) torchrun itself, one agent a host, where Debian's python3-torch is installed.
# Skipped (exit 77), saying why, where network namespaces cannot be made.
#   hosts_parity.sh <build dir> <mpi|gloo> <work dir>
set -euo pipefail
build=$(cd "$1" && pwd)
backend=$2
work=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
hosts="$root/scripts/hosts.sh"
why=$("$hosts" check 2>&1) || { echo "SKIP: $why"; exit 77; }
name="hp${backend:0:1}"
"$hosts" down "$name"  # what an interrupted run of this test left
trap '"$hosts" down "$name"' EXIT
trap 'exit 130' INT TERM  # the EXIT trap removes the hosts
count=2
[ "$backend" = mpi ] && count=4
"$hosts" up "$count" "$name"
export FIVEFOLD_BACKEND=$backend OMP_WAIT_POLICY=passive
fivefold="$build/bin/fivefold"
rm -rf "$work"
mkdir -p "$work"
cd "$root"

echo "== the reduced parity matrix across $count hosts ($backend)"
bash scripts/parity-matrix.sh --reduced --hosts "$name" "$count" "$build" "$work/matrix"

echo "== saved across 2 hosts (tp 2 x pp 2), resumed on one machine (dp 2, ZeRO-3)"
model=(--d-model 32 --n-layers 4 --n-heads 4 --n-kv-heads 2 --d-ff 64 --seq 16 --batch 24
       --synthetic-examples 300 --warmup 1 --eval-every 0 --exact-match 0 --no-progress
       --peak-gflops 100 --decay-steps 8)
"$hosts" mpirun "$name" --per-host 2 -- -np 4 "$fivefold" train --out "$work/resumed" \
  "${model[@]}" --steps 4 --tp 2 --pp 2 --schedule 1f1b --accum 2 >"$work/across.log" 2>&1 ||
  { cat "$work/across.log"; echo "FAIL: the run across hosts failed"; exit 1; }
mpi=(mpirun --oversubscribe)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
"${mpi[@]}" -np 2 "$fivefold" train --out "$work/resumed" --resume "${model[@]}" --steps 8 \
  --dp 2 --zero 3 >"$work/resume.log" 2>&1 ||
  { cat "$work/resume.log"; echo "FAIL: the resume on one machine failed"; exit 1; }
grep -q "from step 4" "$work/resume.log" ||
  { cat "$work/resume.log"; echo "FAIL: the resume did not start from step 4"; exit 1; }
"$fivefold" train --out "$work/single" "${model[@]}" --steps 8 >"$work/single.log" 2>&1 ||
  { cat "$work/single.log"; exit 1; }
"$fivefold" compare --runs "$work/resumed,$work/single" --tolerance 1e-4 --check-steps 8 --rows 8

if [ "$backend" = gloo ] && ! command -v torchrun >/dev/null; then
  echo "== torchrun: not installed (Debian's python3-torch), so not run"
elif [ "$backend" = gloo ]; then
  echo "== torchrun itself: one agent a host, 2 ranks each, meeting at $name-1 (c10d rendezvous)"
  # Torch 1.13's torchrun fails in its own argument handling without --redirects and --tee.
  pids=()
  for h in 1 2; do
    "$hosts" run "$name-$h" torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d \
      --rdzv_endpoint "$name-1:29400" --rdzv_id "$name" --no_python --redirects 1 --tee 1 \
      --log_dir "$work/torchrun-logs-$h" "$fivefold" train --out "$work/torchrun" "${model[@]}" \
      --steps 4 --tp 2 >"$work/torchrun-$h.log" 2>&1 &
    pids+=($!)
  done
  for h in 1 2; do
    wait "${pids[$((h - 1))]}" ||
      { cat "$work"/torchrun-*.log; echo "FAIL: torchrun's agent on host $h failed"; exit 1; }
  done
  "$fivefold" compare --runs "$work/torchrun,$work/single" --tolerance 1e-4 --check-steps 4 --rows 4
fi

if [ "$backend" = mpi ]; then
  echo "== the main preset's 5D layout, 16 ranks over 2 hosts"
  preset=chapters/15_trainer_5d/presets/main.toml
  "$hosts" mpirun "$name" --per-host 8 -- -np 16 "$fivefold" train --config "$preset" \
    --out "$work/main-5d" --steps 3 --eval-every 0 --no-progress >"$work/main-5d.log" 2>&1 ||
    { cat "$work/main-5d.log"; echo "FAIL: the main preset across hosts failed"; exit 1; }
  "$fivefold" train --config "$preset" --out "$work/main-single" --steps 3 --eval-every 0 \
    --no-progress --tp 1 --pp 1 --cp 1 --ep 1 --zero 0 --sequence-parallel=false \
    >"$work/main-single.log" 2>&1 || { cat "$work/main-single.log"; exit 1; }
  "$fivefold" compare --runs "$work/main-5d,$work/main-single" --tolerance 1e-4 --check-steps 3

  echo "== fivefold calibrate over 2 hosts, 2 ranks each: the node's link and the nodes' apart"
  "$hosts" mpirun "$name" --per-host 2 -- -np 4 "$fivefold" calibrate \
    --cluster-out "$work/two-hosts.toml" --d-model 32 --n-layers 1 --n-heads 4 --seq 16 \
    --batch 4 --timed-steps 2 --sizes 4096,65536,1048576 >"$work/calibrate.log" 2>&1 ||
    { cat "$work/calibrate.log"; echo "FAIL: calibrate across hosts failed"; exit 1; }
  cat "$work/two-hosts.toml"
  grep -q '"hosts":2' "$work/two-hosts.toml" && grep -q '^devices-per-node = 2$' "$work/two-hosts.toml" ||
    { echo "FAIL: calibrate did not see 2 hosts of 2 ranks"; exit 1; }
  for key in intra-node-send-recv-gbps inter-node-send-recv-gbps inter-node-all-reduce-gbps; do
    grep -q "^$key = [0-9]" "$work/two-hosts.toml" || { echo "FAIL: no $key"; exit 1; }
  done
  intra=$(sed -n 's/^intra-node-send-recv-gbps = //p' "$work/two-hosts.toml")
  inter=$(sed -n 's/^inter-node-send-recv-gbps = //p' "$work/two-hosts.toml")
  [ "$intra" != "$inter" ] || { echo "FAIL: one line for shared memory and TCP ($intra GB/s)"; exit 1; }
fi
echo "ok: every run across the hosts gave the one process's curve"
