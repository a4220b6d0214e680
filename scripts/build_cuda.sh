#!/usr/bin/env bash
# Builds the CUDA hilum (`--features cuda,onnx-gpu`, release) and prints how long it took.
# Where no CUDA toolkit is installed (no nvcc on PATH), scripts/setup_cuda_build.sh installs a
# pinned one from PyPI first. CUDA_COMPUTE_CAP picks the GPU generation of the static kernels
# (default: the first GPU's, else 90). The binary needs the NVIDIA driver (libcuda.so.1) and
# cuBLAS/cuRAND/the CUDA runtime at start: run it on the GPU machine (scripts/gpu_check.sh finds
# the libraries).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
t0=$(date +%s)
if ! command -v nvcc >/dev/null 2>&1; then
  eval "$("$root/scripts/setup_cuda_build.sh")"
fi
if [ -z "${CUDA_COMPUTE_CAP:-}" ]; then
  cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d . || true)"
  export CUDA_COMPUTE_CAP="${cap:-90}"
fi
echo "building hilum with CUDA $(nvcc --version | grep -oE 'release [0-9.]+') for compute capability $CUDA_COMPUTE_CAP" >&2
CARGO_INCREMENTAL=0 cargo build --release -p hilum-cli --features "${FEATURES:-cuda,onnx-gpu}"
echo "built target/release/hilum in $(( $(date +%s) - t0 )) s" >&2
