#!/usr/bin/env bash
# Runs the whole test suite. Installs, on first use, what the tests need beyond Cargo
# (each step is idempotent and pinned), then runs `cargo test --workspace`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d ../shared/data ]; then
  echo "error: ../shared/data (the real radiographs the tests use) is missing beside the checkout" >&2
  exit 2
fi

# Optional set-up steps contributed by the crates (ONNX Runtime, local model, browser, ...).
for step in scripts/setup_*.sh; do
  [ -e "$step" ] || continue
  echo "== $step"
  # shellcheck disable=SC1090
  source "$step"
done

cargo test --workspace "$@"
