#!/usr/bin/env bash
# Triton vs in-process for classify_chest_xray, side by side in one run on one machine: per-call
# latency one call at a time, the batched forward at batch 1 and 16, and bursts of 16 concurrent
# calls (Triton's dynamic batcher batches a burst). DenseNet-121 at full size with seeded weights
# (the published ones cannot be downloaded everywhere), imported as a site checkpoint, exported
# with `hilum models export-triton` and served by a real Triton (scripts/setup_triton.sh).
#
# Usage: scripts/bench/bench_triton.sh [hilum bench options…]   (separately run, NOT part of CI)
# Env:   HILUM_BIN (default target/release/hilum, built if missing), IMAGE (a radiograph),
#        TRITON_THREADS (ONNX Runtime threads per Triton model, default all cores),
#        HILUM_CPU_THREADS (the in-process backends' threads, default all cores).
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${HILUM_BIN:-$root/target/release/hilum}"
image="${IMAGE:-$root/../shared/data/cxr/images/covid_2c35005f.jpg}"
[ -f "$image" ] || { echo "bench_triton: no image at $image (shared data beside the checkout, or IMAGE=…)" >&2; exit 1; }
if [ ! -x "$bin" ]; then
    echo "building $bin ..." >&2
    (cd "$root" && cargo build --release -p hilum-cli >&2)
fi
work="$(mktemp -d)"
triton_pid=""
cleanup() {
    if [ -n "$triton_pid" ]; then kill "$triton_pid" 2>/dev/null || true; wait "$triton_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

bash "$root/scripts/setup_triton.sh" >&2
export HILUM_MODELS_DIR="$work/models"
(cd "$root" && cargo run --release -q -p hilum-models --example seeded_classifier -- "$work/densenet.safetensors" >&2)
"$bin" models import --custom densenet121-res224-all "$work/densenet.safetensors" >&2
"$bin" models export-triton "$work/repo" densenet121-res224-all >&2
# shellcheck source=scripts/deploy/triton_start.sh
. "$root/scripts/deploy/triton_start.sh"
triton_start "$work/repo" "$work"
tp=$triton_http_port
echo "== $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; Triton on 127.0.0.1:$tp" >&2
if [ $# -eq 0 ]; then
    set -- --backend native,kserve --batch 1,16 --concurrent 16 -n 10 --no-round
fi
HILUM_KSERVE_URL="http://127.0.0.1:$tp" "$bin" bench --image "$image" --tool classify_chest_xray "$@"
