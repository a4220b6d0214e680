#!/usr/bin/env bash
# Bounded libFuzzer run of the decoder entry point (see fuzz/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${FUZZ_SECONDS:-60}"
DATA="../shared/data/cxr"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
rustup toolchain list | grep -q nightly || { echo "needs a nightly toolchain: rustup toolchain install nightly" >&2; exit 1; }
mkdir -p fuzz/corpus/decode
# Seeds: the smaller real files (libFuzzer ignores inputs above -max_len).
find "$DATA/images" "$DATA/dicom" -maxdepth 1 -type f -size -1024k \( -name '*.png' -o -name '*.jp*g' -o -name '*.dcm' \) \
  -exec cp -n {} fuzz/corpus/decode/ \;
cd fuzz
cargo +nightly fuzz run decode -- -max_total_time="$SECS" -rss_limit_mb=2048 -max_len=1048576 -timeout=20
