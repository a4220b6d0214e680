#!/usr/bin/env bash
# Installs wrk (Debian package) for scripts/deploy/load_test.sh.
set -euo pipefail
if ! command -v wrk >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq wrk
fi
wrk --version 2>&1 | head -1 || true
