#!/usr/bin/env bash
# The prepared GPU check: builds hilum with CUDA (unless given a binary), then runs
# `hilum gpu-check`: every model on the GPU against the CPU with the same weights and inputs,
# DenseNet-121 at batch 1/16/64, the U-Net, the MedSAM encoder, report and LLaVA decoding
# timed on both, one table (and gpu_check.json in $OUT or the current directory).
#
#   scripts/gpu_check.sh                      # build (scripts/build_cuda.sh) and run on cuda:0
#   scripts/gpu_check.sh --bin PATH           # a hilum built with --features cuda elsewhere
#   scripts/gpu_check.sh --dry-run            # no GPU: the CPU against itself, small sizes
#   DEVICE=cuda:1 scripts/gpu_check.sh        # another GPU
#
# Options after the script's own go to `hilum gpu-check` (see `hilum gpu-check --help`).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bin="${HILUM_BIN:-}"
dry=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) extra+=("$1"); shift ;;
  esac
done
out="${OUT:-.}"
t0=$(date +%s)

if [ "$dry" = 1 ]; then
  # The dry run needs no CUDA: the default build, the CPU as both devices.
  if [ -z "$bin" ]; then
    cargo build -q -p hilum-cli
    bin="$root/target/debug/hilum"
  fi
  exec "$bin" gpu-check --dry-run ${extra[@]+"${extra[@]}"}
fi

if [ -z "$bin" ]; then
  "$root/scripts/build_cuda.sh"
  bin="$root/target/release/hilum"
fi

# cuBLAS, cuRAND, NVRTC and the runtime: from the toolkit, or from Python's CUDA wheels.
libs=""
for d in "${CUDA_HOME:-}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && libs="$libs:$d"
done
for py in python3 /opt/torch/.venv/bin/python3; do
  if command -v "$py" >/dev/null 2>&1; then
    for d in $("$py" - <<'PY' 2>/dev/null || true
import glob, os
try:
    import nvidia
    for p in nvidia.__path__:
        for lib in glob.glob(os.path.join(p, "*", "lib")):
            print(lib)
except Exception:
    pass
PY
); do libs="$libs:$d"; done
  fi
done
export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

image=()
case " ${extra[*]-} " in
  *" --image "*) ;;
  *) for f in "$root"/../shared/data/cxr/images/*; do
       [ -f "$f" ] && { image=(--image "$f"); break; }
     done ;;
esac
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
"$bin" gpu-check --device "${DEVICE:-cuda:0}" ${image[@]+"${image[@]}"} \
  --json "$out/gpu_check.json" ${extra[@]+"${extra[@]}"}
echo "gpu check: $(( $(date +%s) - t0 )) s in all" >&2
