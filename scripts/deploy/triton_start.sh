# Sourced by scripts that need a real Triton (deploy_check.sh, bench_triton.sh):
#   triton_start REPO WORK   starts scripts/deploy/triton_serve.py on REPO in the background on free
#                            127.0.0.1 ports, logging to WORK/triton.log, and returns once every
#                            model is bound; sets triton_pid, triton_http_port, triton_metrics_port.
# Triton answers its health route before the models are bound, and its log threads share the
# script's stdout (a `ready` line can arrive spliced), so this waits for the script's ready file.
# Exits the calling script, with the log, when Triton dies or is not ready in 240 s.
triton_start() {
    local repo="$1" work="$2" root grpc port
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
    triton_http_port=$(port); grpc=$(port); triton_metrics_port=$(port)
    "$root/scripts/.venv-triton/bin/python" "$root/scripts/deploy/triton_serve.py" "$repo" \
        --http-port "$triton_http_port" --grpc-port "$grpc" --metrics-port "$triton_metrics_port" \
        --ready-file "$work/triton-ready" --threads "${TRITON_THREADS:-$(nproc)}" \
        > "$work/triton.log" 2>&1 &
    triton_pid=$!
    for _ in $(seq 1 1200); do
        [ -f "$work/triton-ready" ] && return 0
        kill -0 "$triton_pid" 2>/dev/null || { cat "$work/triton.log" >&2; echo "Triton died" >&2; exit 1; }
        sleep 0.2
    done
    cat "$work/triton.log" >&2; echo "Triton not ready in 240 s" >&2; exit 1
}
