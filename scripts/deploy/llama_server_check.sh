#!/usr/bin/env bash
# Interop check against a server we did not write: llama.cpp (via llama-cpp-python's OpenAI-compatible
# server) serves the same GGUF as Hilum's local backend, and `hilum analyze --llm openai:...` runs a
# full tool round against it on a real radiograph.
#
# Separately run, NOT part of CI: installing llama-cpp-python compiles llama.cpp (~20 min on 2 cores).
#
# Usage: scripts/deploy/llama_server_check.sh [MODEL.gguf]
#   env: PORT (default 8089), THREADS (2), LLAMA_CHAT_FORMAT (default: the GGUF's template),
#        IMAGE (a CXR from ../shared/data/cxr/images), KEEP_SERVER=1 to leave it running,
#        HILUM_BIN (an already built `hilum`; default: build target/release/hilum).
# Prints the NDJSON events and exits 0 only if at least one tool call succeeded and a non-empty
# answer came. env MAX_ROUNDS (default 6, as `hilum analyze`): tool rounds before the agent asks
# for the answer.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
MODELS_DIR="${HILUM_MODELS_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/hilum/models}"
MODEL="${1:-$MODELS_DIR/llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}"
PORT="${PORT:-8089}"
THREADS="${THREADS:-2}"
# Served by llama.cpp the 0.5B model repeats its call every round; the agent does not run a call
# that already succeeded and, when a round holds nothing else, asks for the answer.
MAX_ROUNDS="${MAX_ROUNDS:-6}"
# Empty: the GGUF's own chat template (Qwen's, with its tool section); the model then writes
# <tool_call> blocks as text, which Hilum reads as calls. `chatml-function-calling` lets
# llama-cpp-python choose between a message and a call with its own grammar instead.
FORMAT="${LLAMA_CHAT_FORMAT-}"
FORMAT_ARGS=()
[[ -n "$FORMAT" ]] && FORMAT_ARGS=(--chat_format "$FORMAT")
IMAGE="${IMAGE:-$ROOT/../shared/data/cxr/images/covid_pneumocystis-pneumonia-1.jpg}"
VENV="$ROOT/scripts/.venv-llama"

[[ -f "$MODEL" ]] || "$ROOT/scripts/fetch_local_llm.sh" "$MODEL"
[[ -f "$IMAGE" ]] || { echo "missing test image $IMAGE (shared data at ../shared/data)" >&2; exit 1; }

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    echo "installing llama-cpp-python[server] 0.3.36 into $VENV (compiles llama.cpp, ~20 min)"
    python3 -m venv "$VENV"
    # Only the libraries the Python package loads: no llama.cpp tests/examples/server binaries.
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF}" \
        CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        "$VENV/bin/pip" install --quiet "llama-cpp-python[server]==0.3.36"
fi

LOG="$(mktemp)"
"$VENV/bin/python" -m llama_cpp.server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --n_threads "$THREADS" --n_ctx 4096 "${FORMAT_ARGS[@]}" >"$LOG" 2>&1 &
SERVER=$!
cleanup() { [[ "${KEEP_SERVER:-0}" == 1 ]] || kill "$SERVER" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$LOG" >&2; echo "llama.cpp server died" >&2; exit 1; }
    sleep 1
done

cd "$ROOT"
BIN="${HILUM_BIN:-}"
if [[ -z "$BIN" ]]; then
    cargo build --quiet --release -p hilum-cli
    BIN="$ROOT/target/release/hilum"
fi
OUT="$(mktemp)"
OPENAI_API_KEY=none "$BIN" analyze "$IMAGE" \
    --question "What are the width and height of this image in pixels?" \
    --llm openai:qwen2.5-coder-0.5b --base-url "http://127.0.0.1:$PORT/v1" \
    --max-rounds "$MAX_ROUNDS" --json | tee "$OUT"

python3 - "$OUT" <<'PY'
import json, sys
events = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
ok = [e for e in events if e.get("type") == "tool_finished"]
answer = next((e.get("answer", "") for e in events if e.get("type") == "final"), "").strip()
print(f"llama.cpp interop: {len(ok)} tool call(s) finished; answer: {answer!r}")
sys.exit(0 if ok and answer else 1)
PY
