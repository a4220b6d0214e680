#!/usr/bin/env bash
# Side-by-side speed of Hilum's local backend and llama.cpp (llama-cpp-python) on the same GGUF,
# same threads, same agent-shaped prompt (~260 tokens: system prompt, one tool, a question).
#
# Usage: scripts/bench_llm.sh [MODEL.gguf]        env: THREADS (default 2), SKIP_LLAMA=1
# The llama.cpp side needs scripts/.venv-llama from scripts/llama_server_check.sh (a ~20 min compile).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODELS_DIR="${HILUM_MODELS_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/hilum/models}"
MODEL="${1:-$MODELS_DIR/llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}"
THREADS="${THREADS:-2}"
cd "$ROOT"

echo "== hilum local backend (candle), $THREADS threads"
RAYON_NUM_THREADS="$THREADS" cargo run --quiet --release -p hilum-llm --example bench_local -- "$MODEL" \
    | tee /tmp/bench_hilum.jsonl

if [[ "${SKIP_LLAMA:-0}" == 1 ]]; then exit 0; fi
PY="$ROOT/scripts/.venv-llama/bin/python"
[[ -x "$PY" ]] || { echo "no llama-cpp-python venv: run scripts/llama_server_check.sh first (or SKIP_LLAMA=1)" >&2; exit 1; }
echo "== llama.cpp (llama-cpp-python), $THREADS threads"
"$PY" "$ROOT/scripts/bench_llm_llamacpp.py" "$MODEL" "$THREADS" | tee /tmp/bench_llama.jsonl

python3 - <<'PY'
import json
h = [json.loads(l) for l in open("/tmp/bench_hilum.jsonl") if l.startswith("{")][0]
l = [json.loads(x) for x in open("/tmp/bench_llama.jsonl") if x.startswith("{")][0]
print(f"prompt  tok/s: hilum {h['prefill_tok_s']:.1f}  llama.cpp {l['prefill_tok_s']:.1f}  ratio {h['prefill_tok_s']/l['prefill_tok_s']:.2f}")
print(f"decode  tok/s: hilum {h['decode_tok_s']:.1f}  llama.cpp {l['decode_tok_s']:.1f}  ratio {h['decode_tok_s']/l['decode_tok_s']:.2f}")
print(f"first tool call s: hilum {h['first_tool_call_s']:.2f}  llama.cpp (prompt+generation) {l['total_s']:.2f}")
PY
