#!/usr/bin/env bash
# Load test of `hilum serve` on 127.0.0.1 only, bounded in time, with wrk:
#   1. direct tool calls: POST /v1/tools/image_info:call on a real radiograph;
#   2. full sessions: POST /v1/sessions/{id}/messages with the script LLM (one tool round +
#      answer), streamed NDJSON read to the end.
# Reports requests/s, p50/p99 latency and errors per phase, then checks the audit log against
# what the server answered: audit rows == calls made, nothing lost.
#
# Usage: scripts/deploy/load_test.sh [SECONDS_PER_PHASE=10] [CONNECTIONS=8]
#        scripts/deploy/load_test.sh --soak [SECONDS=300] [SESSIONS=30]
#        scripts/deploy/load_test.sh --pacs [STUDIES=200] [ASSOCIATIONS=4]   (the DICOM node:
#          scripts/deploy/load_test_pacs.py; studies/min and p50/p95 from last instance to results)
#   --soak: SESSIONS concurrent sessions (one thread each, scripts/deploy/soak.py) ask for SECONDS, one
#   question after another, questions whose scripted model calls the real lung U-Net
#   (`segment_lungs`) on eight shared radiographs, with a 64 MiB image bound
#   (SOAK_IMAGE_MB) so images are evicted and read back. Checks: 0 errors, every run completed,
#   audit rows = tool calls = runs, peak RSS <= SOAK_MAX_RSS_MB (default 1536) and no growth
#   after warm-up (the last third's highest sample <= the middle third's + 10% + 32 MiB).
# Env:   HILUM_BIN (default: target/release/hilum, built if missing), IMAGE (a radiograph),
#        LOAD_POSTGRES_URL (a PostgreSQL server, e.g. $HILUM_TEST_POSTGRES_URL from
#        scripts/setup_postgres.sh: the test then runs on a fresh database there, dropped at
#        the end, instead of a SQLite file).
# Needs: wrk (scripts/setup_load_test.sh), curl, python3.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
if [ "${1:-}" = "--pacs" ]; then
    # The DICOM node: scripts/deploy/load_test_pacs.py (pydicom from scripts/setup_pacs_tools.sh).
    shift
    eval "$(bash "$root/scripts/setup_pacs_tools.sh")"
    bin="${HILUM_BIN:-$root/target/release/hilum}"
    [ -x "$bin" ] || (cd "$root" && cargo build --release -p hilum-cli >&2)
    HILUM_BIN="$bin" exec "$HILUM_PACS_PYTHON" "$root/scripts/deploy/load_test_pacs.py" "$@"
fi
soak=""
if [ "${1:-}" = "--soak" ]; then soak=1; shift; fi
secs="${1:-$([ -n "$soak" ] && echo 300 || echo 10)}"
conns="${2:-$([ -n "$soak" ] && echo 30 || echo 8)}"
image="${IMAGE:-$root/../shared/data/cxr/images/nih_00000001_000_cardiomegaly.png}"
bin="${HILUM_BIN:-$root/target/release/hilum}"

[ -n "$soak" ] || command -v wrk >/dev/null || { echo "wrk is missing: run scripts/setup_load_test.sh" >&2; exit 1; }
[ -f "$image" ] || { echo "test image not found: $image" >&2; exit 1; }
if [ ! -x "$bin" ]; then
    echo "building $bin ..." >&2
    (cd "$root" && cargo build --release -p hilum-cli >&2)
fi

work="$(mktemp -d)"
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
base="http://127.0.0.1:$port"
db="sqlite://$work/load.db"
pg_db=""
if [ -n "${LOAD_POSTGRES_URL:-}" ]; then
    command -v psql >/dev/null || { echo "psql is missing: run scripts/setup_postgres.sh" >&2; exit 1; }
    pg_db="hilum_load_$$"
    psql -X -q "$LOAD_POSTGRES_URL" -c "CREATE DATABASE $pg_db" >&2
    # The same server, the new database (the path after host:port).
    db="$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/" + sys.argv[2])))' "$LOAD_POSTGRES_URL" "$pg_db")"
fi
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
    if [ -n "$pg_db" ]; then psql -X -q "$LOAD_POSTGRES_URL" -c "DROP DATABASE IF EXISTS $pg_db WITH (FORCE)" >&2 || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

wait_idle() {
    # Let requests still in flight finish, then read the server's counters.
    for _ in $(seq 1 100); do
        sleep 0.2
        metrics="$(curl -fsS "$base/metrics" | grep -v 'route="/metrics"')"
        if grep -q '^hilum_runs_active 0$' <<<"$metrics" \
            && [ "$metrics" = "$(curl -fsS "$base/metrics" | grep -v 'route="/metrics"')" ]; then
            break
        fi
    done
}

# start_server NAME [FLAGS...]: a token named NAME, then `hilum serve` with the script model
# ($work/script.json) and FLAGS, waited for until it answers.
start_server() {
    local name="$1"; shift
    token="$("$bin" serve token create --name "$name" --admin --db "$db" 2>/dev/null)"
    "$bin" serve --db "$db" --bind "127.0.0.1:$port" --llm "script:$work/script.json" \
        --rate-limit 0 "$@" > "$work/server.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 100); do
        curl -fsS "$base/healthz" >/dev/null 2>&1 && break
        sleep 0.1
    done
    curl -fsS "$base/healthz" >/dev/null || { cat "$work/server.log" >&2; exit 1; }
    auth="Authorization: Bearer $token"
}

# upload FILE: prints the image id.
upload() {
    curl -fsS -H "$auth" -F "file=@$1" "$base/v1/images" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["images"][0]["id"])'
}

if [ -n "$soak" ]; then
    shared="$root/../shared/data"
    weights="$shared/models/lung_seg_unet/lung_seg_valiou_088.h5"
    [ -f "$weights" ] || { echo "the lung U-Net is missing: $weights" >&2; exit 1; }
    export HILUM_MODELS_DIR="$work/models"
    "$bin" models import lung-unet "$weights" >&2
    cat > "$work/script.json" <<'JSON'
[
  {"content": "Segmenting.", "tool_calls": [{"name": "segment_lungs", "arguments": {"image": "$IMAGE"}}]},
  {"content": "The segment_lungs result gives each lung's area."}
]
JSON
    start_server soak --max-image-memory-mb "${SOAK_IMAGE_MB:-64}"
    images=""
    for f in covid_0a7faa2a.jpg covid_2c35005f.jpg derived_RG1_chest_pa_16bit.png \
        kermany_IM-0025-0001_normal.jpeg medrax_normal1.jpg nih_00000001_000_cardiomegaly.png \
        nih_00004387_000_effusion.png tbx11k_h0001_healthy.png; do
        images="$images$(upload "$shared/cxr/images/$f"),"
    done
    sessions=""
    for _ in $(seq 1 "$conns"); do
        sid="$(curl -fsS -H "$auth" -H 'content-type: application/json' -d '{"title":"soak"}' "$base/v1/sessions" \
            | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
        sessions="$sessions$sid,"
    done
    echo "# hilum soak: $conns sessions x ${secs}s of segment_lungs runs, $(nproc) cores, loopback, database ${db%%://*}" >&2
    soak_json="$(python3 "$root/scripts/deploy/soak.py" "$base" "$token" "$server_pid" "$secs" "${sessions%,}" "${images%,}")"
    wait_idle
    kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
    "$bin" serve audit export --db "$db" > "$work/audit.jsonl"
    rc=0
    python3 - "$work/audit.jsonl" "$soak_json" "$metrics" "${SOAK_MAX_RSS_MB:-1536}" <<'PY' || rc=$?
import json, re, sys
audit = [json.loads(l) for l in open(sys.argv[1])]
soak, metrics, max_rss = json.loads(sys.argv[2]), sys.argv[3], float(sys.argv[4])

def metric(name, labels=""):
    m = re.search(r'^%s%s (\d+(?:\.\d+)?)$' % (re.escape(name), re.escape(labels)), metrics, re.M)
    return float(m.group(1)) if m else 0.0

completed = int(metric("hilum_runs_total", '{status="completed"}'))
executed = sum(int(v) for v in re.findall(r'^hilum_tool_call_duration_seconds_count\{[^}]*\} (\d+)$', metrics, re.M))
tool_rows = sum(1 for a in audit if a["kind"] == "tool_call")
seg_rows = sum(1 for a in audit if a["kind"] == "tool_call" and a["name"] == "segment_lungs")
llm_rows = sum(1 for a in audit if a["kind"] == "llm_call")
rss = [s[1] for s in soak["rss_mib_samples"]]
third = max(1, len(rss) // 3)
middle, last = rss[third:2 * third] or rss, rss[2 * third:] or rss
evictions = {k: v for k, v in re.findall(r'^(hilum_image\w*) (\d+)$', metrics, re.M)}
soak["server"] = {
    "runs_completed": completed,
    "runs_failed": int(metric("hilum_runs_total", '{status="failed"}')),
    "runs_cancelled": int(metric("hilum_runs_total", '{status="cancelled"}')),
    "tool_calls_executed": executed,
    "image_metrics": evictions,
}
soak["audit"] = {"tool_calls": tool_rows, "segment_lungs": seg_rows, "llm_calls": llm_rows}
soak["rss_mib_samples"] = ["%.0f s: %.0f MiB after %d runs" % tuple(s) for s in soak["rss_mib_samples"][::max(1, len(rss) // 12)]]
checks = {
    "zero_errors": not soak["errors"] and soak["server"]["runs_failed"] == 0 and soak["server"]["runs_cancelled"] == 0,
    "every_answer_is_a_completed_run": soak["runs_ok"] == completed > 0,
    "audit_rows_equal_calls": tool_rows == seg_rows == executed == completed and llm_rows == 2 * completed,
    "peak_rss_within_bound": 0 < soak["peak_rss_mib"] <= max_rss,
    "no_growth_after_warm_up": max(last) <= max(middle) * 1.10 + 32,
}
soak["checks"] = checks
print(json.dumps(soak, indent=2))
sys.exit(0 if all(checks.values()) else 1)
PY
    if [ "$rc" != 0 ]; then
        cp "$work/server.log" "$root/target/soak-server.log" 2>/dev/null \
            && echo "soak failed; the server's log is in target/soak-server.log" >&2
    fi
    exit "$rc"
fi

cat > "$work/script.json" <<'JSON'
[
  {"content": "Measuring.", "tool_calls": [{"name": "image_info", "arguments": {"image": "$IMAGE"}}]},
  {"content": "The image_info result gives the size and the intensity statistics."}
]
JSON

start_server load-test
img_id="$(upload "$image")"

# Sessions are spread so no single conversation history grows without bound.
nsessions=$((conns * 4))
sessions=""
for _ in $(seq 1 "$nsessions"); do
    sid="$(curl -fsS -H "$auth" -H 'content-type: application/json' -d '{"title":"load"}' "$base/v1/sessions" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
    sessions="$sessions\"$sid\","
done

report_lua='
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "{\"requests\": %d, \"seconds\": %.3f, \"rps\": %.1f, \"p50_ms\": %.2f, \"p99_ms\": %.2f, \"max_ms\": %.2f, \"errors\": {\"connect\": %d, \"read\": %d, \"write\": %d, \"status\": %d, \"timeout\": %d}}\n",
    summary.requests, summary.duration / 1e6, summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency.max / 1000,
    e.connect, e.read, e.write, e.status, e.timeout))
end
'

cat > "$work/tool.lua" <<LUA
wrk.method = "POST"
wrk.headers["Authorization"] = "Bearer $token"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"image": "$img_id"}'
$report_lua
LUA

cat > "$work/session.lua" <<LUA
local sessions = { ${sessions%,} }
local n = 0
request = function()
  n = n + 1
  local sid = sessions[(n % #sessions) + 1]
  return wrk.format("POST", "/v1/sessions/" .. sid .. "/messages",
    {["Authorization"] = "Bearer $token", ["Content-Type"] = "application/json"},
    '{"question": "How large is this image?", "images": ["$img_id"]}')
end
$report_lua
LUA

echo "# hilum load test: ${secs}s per phase, $conns connections, 2 wrk threads, $(nproc) cores, loopback, database ${db%%://*}" >&2
tools_json="$(wrk -t2 -c"$conns" -d"${secs}s" --timeout 30s -s "$work/tool.lua" "$base/v1/tools/image_info:call" | tail -1)"
sessions_json="$(wrk -t2 -c"$conns" -d"${secs}s" --timeout 30s -s "$work/session.lua" "$base" | tail -1)"

# Let requests still in flight when wrk stopped finish, then read the server's counters.
wait_idle
# Stop the server, then read its audit log from the database.
kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
"$bin" serve audit export --db "$db" > "$work/audit.jsonl"

python3 - "$work/audit.jsonl" "$tools_json" "$sessions_json" "$metrics" <<'PY'
import json, re, sys
audit = [json.loads(l) for l in open(sys.argv[1])]
tools, sessions, metrics = json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]

def served(route, status="200"):
    m = re.search(r'hilum_http_requests_total\{method="POST",route="%s",status="%s"\} (\d+)' % (re.escape(route), status), metrics)
    return int(m.group(1)) if m else 0

def runs(status):
    m = re.search(r'hilum_runs_total\{status="%s"\} (\d+)' % status, metrics)
    return int(m.group(1)) if m else 0

direct_audit = sum(1 for a in audit if a["kind"] == "tool_call" and a["run_id"] is None)
# Runs that wrk cut at its deadline are cancelled (client gone); count the others.
cancelled = {a["run_id"] for a in audit if a["kind"] == "run_cancelled"}
run_tool_audit = sum(1 for a in audit if a["kind"] == "tool_call" and a["run_id"] not in (None, *cancelled))
llm_audit = sum(1 for a in audit if a["kind"] == "llm_call" and a["run_id"] not in cancelled)
completed = runs("completed")
result = {
    "tool_calls": tools,
    "sessions": sessions,
    "server": {
        "tool_calls_answered_200": served("/v1/tools/{call}"),
        "questions_answered_200": served("/v1/sessions/{id}/messages"),
        "runs_completed": completed,
        "runs_cancelled": runs("cancelled"),
        "runs_failed": runs("failed"),
    },
    "audit": {"direct_tool_calls": direct_audit, "run_tool_calls": run_tool_audit, "llm_calls": llm_audit},
}
executed = sum(int(v) for v in re.findall(r'^hilum_tool_call_duration_seconds_count\{[^}]*\} (\d+)$', metrics, re.M))
all_tool_audit = sum(1 for a in audit if a["kind"] == "tool_call")
result["server"]["tool_calls_executed"] = executed
result["audit"]["all_tool_calls"] = all_tool_audit
checks = {
    # Every tool call the server executed (direct and in runs) has exactly one audit row.
    "every_executed_call_audited_once": all_tool_audit == executed,
    # Every direct call answered is audited (a call whose client hung up at wrk's deadline is
    # executed and audited but never answered, so >=).
    "answered_direct_calls_audited": direct_audit >= result["server"]["tool_calls_answered_200"],
    # Each completed run made one tool call and two model calls.
    "run_calls_all_audited": run_tool_audit == completed and llm_audit == 2 * completed,
    # wrk counts only responses it finished before the deadline; the server may finish a few more.
    "client_count_within_server_count": tools["requests"] <= direct_audit and sessions["requests"] <= completed,
    "zero_errors": all(v == 0 for v in tools["errors"].values()) and all(v == 0 for v in sessions["errors"].values())
                   and result["server"]["runs_failed"] == 0,
}
result["checks"] = checks
print(json.dumps(result, indent=2))
sys.exit(0 if all(checks.values()) else 1)
PY
