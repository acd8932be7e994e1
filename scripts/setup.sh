#!/usr/bin/env bash
# Installs every Debian package fivefold needs (with --benchmarks, python3-torch too). Idempotent:
# packages already present are skipped, so a second run costs a few seconds. Run as root or with
# sudo available.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache      # compiler, build system, compiler cache
  clang                                         # the compiler the presets use: builds ~4x faster
  libtorch-dev libgloo-dev                      # LibTorch 1.13 (+ c10d/Gloo headers)
  libopenblas0-openmp                           # fast BLAS: reference BLAS is ~15x slower
  libdnnl-dev                                   # oneDNN's headers: linear's products (fast path)
  openmpi-bin libopenmpi-dev                    # MPI backend and the mpirun launcher
  libgtest-dev libgmock-dev                     # GoogleTest
  nlohmann-json3-dev                            # config.json and safetensors headers
  libcli11-dev                                  # flags (CLI11)
  libtomlplusplus-dev                           # TOML config files (toml++, a strict parser)
  libsentencepiece-dev                          # fivefold tokenize: SentencePiece models
  doxygen                                       # `docs` target
  iproute2                                      # ip netns: the tests' hosts (scripts/hosts.sh)
)

# --benchmarks: also PyTorch for Python (benchmarks/run_vs_pytorch.sh); never needed to build or test.
if [ "${1:-}" = "--benchmarks" ]; then packages+=(python3-torch); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi

# LibTorch reaches BLAS through Debian's alternatives; make sure OpenBLAS is the one selected.
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || true)
case "$blas" in
  *openblas*) echo "setup: BLAS is $blas" ;;
  *) echo "setup: WARNING: libblas.so.3 resolves to '$blas', not OpenBLAS; matmul will be ~15x slower" >&2 ;;
esac
