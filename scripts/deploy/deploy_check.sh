#!/usr/bin/env bash
# The hospital deployment on one machine, every part real and on 127.0.0.1:
#
#   workstation (curl) -> hilum serve replica A --+--> PostgreSQL (sessions, images, audit; TLS)
#                      -> hilum serve replica B --+--> Triton Inference Server (the lung U-Net,
#                                                 |    KServe v2, exported by Hilum)
#                                                 +--> an OpenAI-compatible reasoning server
#                                                      (llama.cpp's, serving the local GGUF)
#
# The image is uploaded through replica A, the question asked through replica B; the check passes
# when the run completes, `segment_lungs` ran on Triton (its inference counter moved), the answer
# is not empty, and both replicas see the same conversation and audit rows.
#
# Usage: scripts/deploy/deploy_check.sh            (separately run, NOT part of CI)
# Env:   HILUM_BIN (default target/release/hilum, built if missing), IMAGE (a radiograph),
#        LLM_TIMEOUT_SECS (the reasoning server's longest turn, default 900).
# Needs: scripts/setup_postgres.sh and scripts/setup_triton.sh (run here on first use), and for
#        the reasoning server llama-cpp-python in scripts/.venv-llama (scripts/deploy/llama_server_check.sh
#        installs it, ~20 min); without it the replicas use the scripted model and say so.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${HILUM_BIN:-$root/target/release/hilum}"
image="${IMAGE:-$root/../shared/data/cxr/images/covid_2c35005f.jpg}"
weights="$root/../shared/data/models/lung_seg_unet/lung_seg_valiou_088.h5"
[ -f "$image" ] && [ -f "$weights" ] || { echo "shared data missing beside the checkout (../shared/data)" >&2; exit 1; }
if [ ! -x "$bin" ]; then
    echo "building $bin ..." >&2
    (cd "$root" && cargo build --release -p hilum-cli >&2)
fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_for() { # URL SECONDS PID LOG
    for _ in $(seq 1 $(($2 * 5))); do
        curl -fsS "$1" >/dev/null 2>&1 && return 0
        kill -0 "$3" 2>/dev/null || { cat "$4" >&2; echo "deploy_check: the process behind $1 died" >&2; exit 1; }
        sleep 0.2
    done
    cat "$4" >&2; echo "deploy_check: $1 did not answer in $2 s" >&2; exit 1
}
t_start=$(date +%s.%N)
work="$(mktemp -d)"
pids=()
pg_db=""
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    if [ -n "$pg_db" ]; then psql -X -q "$HILUM_TEST_POSTGRES_URL" -c "DROP DATABASE IF EXISTS $pg_db WITH (FORCE)" >&2 || true; fi
    [ -n "${KEEP_WORK:-}" ] || rm -rf "$work"
}
trap cleanup EXIT

echo "== PostgreSQL (TLS, verify-full)" >&2
eval "$(bash "$root/scripts/setup_postgres.sh" | grep '^export ')"
pg_db="hilum_deploy_$$"
psql -X -q "$HILUM_TEST_POSTGRES_URL" -c "CREATE DATABASE $pg_db" >&2
db="$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/" + sys.argv[2])))' "$HILUM_TEST_POSTGRES_URL" "$pg_db")"
export HILUM_DB_CA_FILE="$HILUM_TEST_POSTGRES_CA"

echo "== Triton: the lung U-Net exported by hilum, served over KServe v2" >&2
bash "$root/scripts/setup_triton.sh" >&2
export HILUM_MODELS_DIR="$work/models"
"$bin" models import lung-unet "$weights" >&2
"$bin" models import lung-unet "${weights%.h5}.onnx" >&2  # Triton serves the model's ONNX graph
"$bin" models export-triton "$work/triton-repo" lung-unet >&2
# shellcheck source=scripts/deploy/triton_start.sh
. "$root/scripts/deploy/triton_start.sh"
triton_start "$work/triton-repo" "$work"
pids+=("$triton_pid")
tp=$triton_http_port; tm=$triton_metrics_port
triton_count() {
    curl -fsS "http://127.0.0.1:$tm/metrics" \
        | awk '/^nv_inference_request_success\{.*model="lung-unet"/ {s += $2} END {print s + 0}'
}

echo "== the reasoning model" >&2
llm_args=()
reasoner=""
if [ -x "$root/scripts/.venv-llama/bin/python" ] && "$root/scripts/.venv-llama/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    gguf="${XDG_DATA_HOME:-$HOME/.local/share}/hilum/models/llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    [ -f "$gguf" ] || bash "$root/scripts/fetch_local_llm.sh" >&2
    lp=$(free_port)
    "$root/scripts/.venv-llama/bin/python" -m llama_cpp.server --model "$gguf" --host 127.0.0.1 \
        --port "$lp" --n_threads 2 --n_ctx 4096 > "$work/llm.log" 2>&1 &
    pids+=($!)
    wait_for "http://127.0.0.1:$lp/v1/models" 120 "${pids[-1]}" "$work/llm.log"
    # A 0.5B model on a shared 2-core CPU can take minutes for one turn: wait for it.
    printf '[llm]\ntimeout_secs = %s\n' "${LLM_TIMEOUT_SECS:-900}" > "$work/hilum.toml"
    llm_args=(--llm openai:qwen2.5-coder-0.5b --base-url "http://127.0.0.1:$lp/v1" --config "$work/hilum.toml")
    reasoner="llama.cpp's OpenAI-compatible server (Qwen2.5-Coder-0.5B GGUF)"
    export OPENAI_API_KEY=none
else
    cat > "$work/script.json" <<'JSON'
[
  {"content": "Segmenting.", "tool_calls": [{"name": "segment_lungs", "arguments": {"image": "$IMAGE"}}]},
  {"content": "The segment_lungs result gives each lung's area."}
]
JSON
    llm_args=(--llm "script:$work/script.json")
    reasoner="the scripted model (no llama-cpp-python in scripts/.venv-llama: run scripts/deploy/llama_server_check.sh once)"
fi

echo "== two hilum serve replicas on the one database, CNNs on Triton" >&2
token="$("$bin" serve token create --name deploy-check --db "$db" 2>/dev/null)"
auth="Authorization: Bearer $token"
ports=()
for name in a b; do
    port=$(free_port)
    HILUM_BACKEND=kserve HILUM_KSERVE_URL="http://127.0.0.1:$tp" \
        "$bin" serve --db "$db" --bind "127.0.0.1:$port" "${llm_args[@]}" --rate-limit 0 \
        > "$work/serve-$name.log" 2>&1 &
    pids+=($!)
    wait_for "http://127.0.0.1:$port/healthz" 60 "${pids[-1]}" "$work/serve-$name.log"
    ports+=("$port")
done
a="http://127.0.0.1:${ports[0]}"
b="http://127.0.0.1:${ports[1]}"
t_ready=$(date +%s.%N)

before=$(triton_count)
img="$(curl -fsS -H "$auth" -F "file=@$image" "$a/v1/images" | python3 -c 'import json,sys; print(json.load(sys.stdin)["images"][0]["id"])')"
sid="$(curl -fsS -H "$auth" -H 'content-type: application/json' -d '{"title":"deploy check"}' "$a/v1/sessions" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
t_ask=$(date +%s.%N)
curl -fsS -N -H "$auth" -H 'content-type: application/json' \
    -d "{\"question\": \"How large are the lungs in this image?\", \"images\": [\"$img\"]}" \
    "$b/v1/sessions/$sid/messages" > "$work/events.ndjson"
t_done=$(date +%s.%N)
after=$(triton_count)
curl -fsS -H "$auth" "$a/v1/sessions/$sid/messages" > "$work/messages-a.json"
curl -fsS -H "$auth" "$b/v1/sessions/$sid/messages" > "$work/messages-b.json"
for p in "${pids[@]: -2}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
"$bin" serve audit export --db "$db" > "$work/audit.jsonl"

python3 - "$work" "$before" "$after" "$reasoner" "$t_start" "$t_ready" "$t_ask" "$t_done" <<'PY'
import json, sys
work, before, after, reasoner = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
t_start, t_ready, t_ask, t_done = map(float, sys.argv[5:9])
events = [json.loads(l) for l in open(f"{work}/events.ndjson") if l.strip().startswith("{")]
kinds = [e.get("type") for e in events]
finished = [e for e in events if e.get("type") == "tool_finished"]
answer = next((e.get("answer", "") for e in events if e.get("type") == "final"), "").strip()
msgs_a, msgs_b = json.load(open(f"{work}/messages-a.json")), json.load(open(f"{work}/messages-b.json"))
audit = [json.loads(l) for l in open(f"{work}/audit.jsonl")]
seg_rows = [r for r in audit if r.get("kind") == "tool_call" and r.get("name") == "segment_lungs" and r.get("outcome") == "ok"]
checks = {
    "the run completed with an answer": bool(answer),
    "segment_lungs ran": any(e.get("name") == "segment_lungs" for e in finished),
    "Triton served the U-Net (inference count moved)": after > before,
    "replicas A and B show the same conversation": msgs_a == msgs_b and len(json.dumps(msgs_a)) > 2,
    "the audit log holds the segment_lungs call, ok": len(seg_rows) >= 1,
}
print(f"reasoning model: {reasoner}")
print(f"set-up {t_ready - t_start:.1f} s; question answered in {t_done - t_ask:.1f} s "
      f"({len(finished)} tool call(s); Triton lung-unet inferences {before:.0f} -> {after:.0f})")
print(f"answer: {answer[:300]!r}")
for name, ok in checks.items():
    print(f"  [{'ok' if ok else 'FAILED'}] {name}")
if not all(checks.values()):
    print(f"events: {kinds}", file=sys.stderr)
    sys.exit(1)
PY
