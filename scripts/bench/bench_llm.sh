#!/usr/bin/env bash
# Side-by-side speed of Hilum's local backend and llama.cpp (llama-cpp-python) on the same GGUF,
# same threads, same agent-shaped prompt (393 tokens: system prompt, one tool, a question), and
# generation speed on a 128-token answer without tools.
# The two sides alternate REPS times (default 3) so that both see the same machine load; the
# summary gives medians and the per-repetition ratios.
#
# Usage: scripts/bench/bench_llm.sh [MODEL.gguf]        env: THREADS (default 2), REPS (3), SKIP_LLAMA=1
# The llama.cpp side needs scripts/.venv-llama from scripts/deploy/llama_server_check.sh (a ~20 min compile);
# LLAMA_VENV picks another build (e.g. one without AVX-512, to compare with HILUM_LOCAL_SIMD=avx2).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
MODELS_DIR="${HILUM_MODELS_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/hilum/models}"
MODEL="${1:-$MODELS_DIR/llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}"
THREADS="${THREADS:-2}"
REPS="${REPS:-3}"
cd "$ROOT"
[[ -f "$MODEL" ]] || { echo "no model at $MODEL: run scripts/fetch_local_llm.sh" >&2; exit 1; }

cargo build --quiet --release -p hilum-llm-local --example bench_local
PY="${LLAMA_VENV:-$ROOT/scripts/.venv-llama}/bin/python"
if [[ "${SKIP_LLAMA:-0}" != 1 && ! -x "$PY" ]]; then
    echo "no llama-cpp-python venv: run scripts/deploy/llama_server_check.sh first (or SKIP_LLAMA=1)" >&2
    exit 1
fi
OUT="$(mktemp -d)"
echo "machine: $(nproc) cores, $(uptime | sed 's/.*load/load/')"
for rep in $(seq 1 "$REPS"); do
    echo "== rep $rep: hilum local backend (candle), $THREADS threads"
    RAYON_NUM_THREADS="$THREADS" "${CARGO_TARGET_DIR:-target}/release/examples/bench_local" "$MODEL" \
        | tee -a "$OUT/hilum.jsonl"
    if [[ "${SKIP_LLAMA:-0}" != 1 ]]; then
        echo "== rep $rep: llama.cpp (llama-cpp-python), $THREADS threads"
        "$PY" "$ROOT/scripts/bench/bench_llm_llamacpp.py" "$MODEL" "$THREADS" | tee -a "$OUT/llama.jsonl"
    fi
done
echo "machine after: $(uptime | sed 's/.*load/load/')"

python3 - "$OUT" "${SKIP_LLAMA:-0}" <<'PY'
import json, statistics, sys, pathlib
out, skip = pathlib.Path(sys.argv[1]), sys.argv[2] == "1"
h = [json.loads(l) for l in open(out / "hilum.jsonl") if l.startswith("{")]
h1 = [r for r in h if r.get("round") == 1]
h2 = [r for r in h if r.get("round") == 2]
h3 = [r for r in h if r.get("round") == 3]
med = lambda xs: statistics.median(xs)
print(f"hilum  prompt {med([r['prefill_tok_s'] for r in h1]):.1f} tok/s, generation {med([r['decode_tok_s'] for r in h3]):.1f} tok/s "
      f"({h3[0]['decode_tokens']} tokens), first tool call {med([r['first_tool_call_s'] for r in h1]):.2f} s on {h1[0]['prompt_tokens']} prompt tokens; "
      f"round 2 reused {h2[0]['reused']} of {h2[0]['prompt_tokens']} tokens, answered in {med([r['wall_s'] for r in h2]):.2f} s")
if skip:
    sys.exit(0)
rows = [json.loads(x) for x in open(out / "llama.jsonl") if x.startswith("{")]
l = [r for r in rows if "round" not in r]
l3 = [r for r in rows if r.get("round") == 3]
print(f"llama.cpp prompt {med([r['prefill_tok_s'] for r in l]):.1f} tok/s, generation {med([r['decode_tok_s'] for r in l3]):.1f} tok/s "
      f"({l3[0]['completion_tokens']} tokens), prompt + call {med([r['total_s'] for r in l]):.2f} s ({l[0]['prompt_tokens']} prompt tokens)")
for name, hs, ls in [("prompt", h1, l), ("generation", h3, l3)]:
    key = "prefill_tok_s" if name == "prompt" else "decode_tok_s"
    ratios = [a[key] / b[key] for a, b in zip(hs, ls)]
    print(f"{name:10s} ratio hilum/llama.cpp: median {med(ratios):.2f} (per rep: {', '.join(f'{r:.2f}' for r in ratios)})")
ratios = [b["total_s"] / a["first_tool_call_s"] for a, b in zip(h1, l)]
print(f"first tool call: llama.cpp time / hilum time: median {med(ratios):.2f} (per rep: {', '.join(f'{r:.2f}' for r in ratios)})")
PY
