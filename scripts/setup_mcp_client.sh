#!/usr/bin/env bash
# Creates scripts/.venv-mcp with the pinned official MCP Python SDK (PyPI), used by
# scripts/mcp_client_check.py, the hilum-server test `mcp_python_sdk_*` and the hilum-cli tests
# `mcp_remote::` (scripts/mcp_fixture_server.py).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ ! -x "$here/.venv-mcp/bin/python" ]; then
    python3 -m venv "$here/.venv-mcp"
fi
"$here/.venv-mcp/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements-mcp.txt"
"$here/.venv-mcp/bin/python" -c "import mcp, importlib.metadata as m; print('mcp', m.version('mcp'))"
