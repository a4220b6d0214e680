#!/usr/bin/env bash
# Hilum against PyTorch on the same GPU, in one prepared run: DenseNet-121, ResNet-50, the lung
# U-Net, the SAM ViT-B image encoder and two decoders (Qwen2.5-0.5B's shape, MedGemma 4B's decoder
# shape) on the same seeded weights and inputs, each timed on both sides, their outputs compared,
# the ratio Hilum / PyTorch printed per row and everything written to gpu_vs_torch.json (in $OUT,
# else the current directory). fp32 with TF32 off on both sides; bf16 rows for PyTorch alone
# (Hilum has no bf16 path for these yet); fp16 rows for the CNNs on both sides. PyTorch is the machine's own (`python3 -c 'import
# torch'`, or TORCH_PYTHON); its side is scripts/gpu_vs_torch_ports.py. See docs/gpu.md.
#
#   scripts/gpu_vs_torch.sh                    # build Hilum's side with CUDA here, run on cuda:0
#   scripts/gpu_vs_torch.sh --example PATH     # Hilum's side built elsewhere (carried)
#   scripts/gpu_vs_torch.sh --dry-run          # no GPU: the CPU, small sizes, one timed call
#   DEVICE=cuda:1 scripts/gpu_vs_torch.sh -n 50
#
# The CUDA build: `FEATURES=cuda scripts/gpu_vs_torch.sh --build-only` here (nvcc from
# scripts/setup_cuda_build.sh; 13 min on 2 cores), then carry target/gpu/torch_side_by_side.xz
# (stripped and compressed: the binary itself is over the device's 64 MiB carry) and run
# `scripts/gpu_vs_torch.sh --example target/gpu/torch_side_by_side.xz` there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
example="${HILUM_TORCH_EXAMPLE:-}"
dry=0
build_only=0
iters=20
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift ;;
    --example) example="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    -n) iters="$2"; shift 2 ;;
    *) echo "gpu_vs_torch: unknown option $1" >&2; exit 2 ;;
  esac
done
out="${OUT:-.}"
t0=$(date +%s)

if [ -z "$example" ]; then
  if [ "$dry" = 1 ]; then
    # The dry run needs no CUDA: the default build, on the CPU. `--workspace` keeps the
    # dependencies' features those of `cargo test --workspace`, so CI reuses that build.
    cargo build -q --workspace --example torch_side_by_side
    example="$target/debug/examples/torch_side_by_side"
  else
    if ! command -v nvcc >/dev/null 2>&1; then
      eval "$("$root/scripts/setup_cuda_build.sh")"
    fi
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
    CARGO_INCREMENTAL=0 cargo build --release -p hilum-models --features "${FEATURES:-cuda}" \
      --example torch_side_by_side
    example="$target/release/examples/torch_side_by_side"
    echo "built $example in $(( $(date +%s) - t0 )) s" >&2
    # The binary (~235 MB, ~58 MB stripped) is over what travels to the GPU machine beside the
    # tree (64 MiB in all): carry this stripped, xz-compressed copy (~7 MB) instead.
    mkdir -p "$root/target/gpu"
    strip -o "$root/target/gpu/torch_side_by_side" "$example"
    xz -T0 -6 -f "$root/target/gpu/torch_side_by_side"
    echo "carry target/gpu/torch_side_by_side.xz ($(du -h "$root/target/gpu/torch_side_by_side.xz" | cut -f1)); on the GPU machine: scripts/gpu_vs_torch.sh --example target/gpu/torch_side_by_side.xz" >&2
  fi
fi
case "$example" in
  *.xz)
    # A compressed build: unpacked once beside the output.
    unpacked="$(mktemp -d)/torch_side_by_side"
    if command -v xz >/dev/null 2>&1; then
      xz -dc "$example" > "$unpacked"
    else
      python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$example" "$unpacked"
    fi
    chmod +x "$unpacked"
    example="$unpacked"
    ;;
esac
[ "$build_only" = 1 ] && exit 0

# Python with numpy (and PyTorch on the GPU machine): TORCH_PYTHON, else python3 when it has
# numpy, else the pinned venv of scripts/setup_onnxruntime.sh (numpy, no PyTorch).
py="${TORCH_PYTHON:-python3}"
if ! "$py" -c 'import numpy' >/dev/null 2>&1; then
  py="$root/scripts/.venv-models/bin/python"
  [ -x "$py" ] || { echo "gpu_vs_torch: no Python with numpy (set TORCH_PYTHON, or run scripts/setup_onnxruntime.sh)" >&2; exit 2; }
fi

if [ "$dry" = 0 ]; then
  # cuBLAS, cuRAND, NVRTC and the runtime: from the toolkit, or from Python's CUDA wheels.
  libs=""
  for d in "${CUDA_HOME:-}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && libs="$libs:$d"
  done
  for d in $("$py" -c 'import glob, os, nvidia; [print(l) for p in nvidia.__path__ for l in glob.glob(os.path.join(p, "*", "lib"))]' 2>/dev/null || true); do
    libs="$libs:$d"
  done
  export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
fi

args=(--example "$example" --device "${DEVICE:-cuda:0}" --iters "$iters" --out "$out/gpu_vs_torch.json")
[ "$dry" = 1 ] && args+=(--dry-run)
"$py" "$root/scripts/gpu_vs_torch.py" "${args[@]}"
echo "gpu_vs_torch: $(( $(date +%s) - t0 )) s in all" >&2
