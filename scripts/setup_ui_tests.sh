#!/usr/bin/env bash
# Installs what the browser tests of the web UI need (idempotent):
# Debian's chromium + chromium-driver, and playwright-core under tests/ui/node_modules.
# Never runs `npx playwright install`: the browser is the system one (/usr/bin/chromium).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends chromium chromium-driver
fi
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends nodejs npm
fi

cd tests/ui
want=$(node -p 'require("./package-lock.json").packages["node_modules/playwright-core"].version')
have=$(node -p 'try { require("./node_modules/playwright-core/package.json").version } catch { "" }')
if [ "$want" != "$have" ]; then
    npm ci --no-audit --no-fund
fi
echo "UI test setup done: $(chromium --version 2>/dev/null || echo chromium?) ; node $(node --version)"
