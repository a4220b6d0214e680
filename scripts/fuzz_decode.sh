#!/usr/bin/env bash
# Bounded libFuzzer run of the decoder entry point (see fuzz/README.md).
#   FUZZ_SECONDS=60 scripts/fuzz_decode.sh      (default 60 s)
# Seeds are the real files in ../shared/data/cxr, read in place (-seed_inputs), never copied;
# new inputs libFuzzer finds go to fuzz/corpus/decode (gitignored). Exits non-zero on a crash.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${FUZZ_SECONDS:-60}"
DATA="$(cd ../shared/data/cxr && pwd)"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
# cargo-fuzz passes nightly-only flags (-Zsanitizer=address, …). Use a nightly toolchain when one
# is installed; otherwise the stable one with RUSTC_BOOTSTRAP=1, which enables those flags (the
# sanitizer runtime ships with stable's x86_64 Linux std).
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  fuzz=(cargo +nightly fuzz)
else
  export RUSTC_BOOTSTRAP=1
  fuzz=(cargo fuzz)
fi
mkdir -p fuzz/corpus/decode
# Seeds: the real files under 1 MiB (libFuzzer truncates inputs above -max_len anyway).
seeds=$(find "$DATA/images" "$DATA/dicom" -maxdepth 1 -type f -size -1024k \
  \( -name '*.png' -o -name '*.jp*g' -o -name '*.dcm' \) | sort | paste -sd, -)
cd fuzz
"${fuzz[@]}" run decode corpus/decode -- -seed_inputs="$seeds" -max_total_time="$SECS" \
  -rss_limit_mb=2048 -max_len=1048576 -timeout=20 -print_final_stats=1
