#!/usr/bin/env bash
# Runs the whole test suite. Installs, on first use, what the tests need beyond Cargo
# (each step is idempotent and pinned), then runs `cargo test --workspace`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d ../shared/data ]; then
  echo "error: ../shared/data (the real radiographs the tests use) is missing beside the checkout" >&2
  exit 2
fi

# Set-up steps contributed by the crates. Each may append KEY=VALUE lines to $HILUM_SETUP_ENV
# (e.g. ORT_DYLIB_PATH); they are exported for the tests.
export HILUM_SETUP_ENV
HILUM_SETUP_ENV=$(mktemp)
trap 'rm -f "$HILUM_SETUP_ENV"' EXIT
for step in scripts/setup_*.sh; do
  [ -e "$step" ] || continue
  echo "== $step"
  bash "$step"
done
while IFS='=' read -r key value; do
  [ -n "$key" ] && export "$key=$value"
done < "$HILUM_SETUP_ENV"

cargo test --workspace "$@"
