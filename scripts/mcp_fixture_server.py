"""A site's own MCP server for Hilum's remote-tool tests, written with the official MCP Python
SDK (`mcp`, pinned in scripts/requirements-mcp.txt; `bash scripts/setup_mcp_client.sh`).

Usage: mcp_fixture_server.py [--http PORT [--token T]] [--record FILE] [--pid-file FILE]
                             [--broken-schema]

stdio by default; --http serves streamable HTTP at http://127.0.0.1:PORT/mcp, refusing any
request without `Authorization: Bearer T` when --token is given. --record appends every byte
the server receives (stdin, or each HTTP request's line, headers and body) to FILE, so a test
can check what left Hilum. --pid-file is written when `slow_report` starts, so a test can kill
the server in the middle of that call.
"""

import argparse
import base64
import hashlib
import os
import sys
import threading
import time

from mcp.server.mcpserver import MCPServer
from mcp_types import ImageContent

server = MCPServer("site-fixture")
ARGS = None
UPLOADS = {}


@server.tool()
def prior_report(image: str) -> str:
    """The prior radiology report of the patient in `image` (from the RIS)."""
    return f"RIS lookup for {image}: prior study of 2025-01-03, index 0.47."


@server.tool()
def slow_report(image: str) -> str:
    """A report lookup that takes a minute."""
    if ARGS.pid_file:
        with open(ARGS.pid_file, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(60)
    return f"Slow report for {image}."


@server.tool()
def malformed_image(image: str) -> ImageContent:
    """Returns an image whose bytes are not base64."""
    return ImageContent(type="image", data="*** not base64 ***", mime_type="image/png")


@server.tool()
def huge_report(image: str) -> str:
    """Returns a 10 MB report."""
    return "x" * 10_000_000


@server.tool()
def environment() -> dict:
    """The names of the environment variables this server sees."""
    return {"names": sorted(os.environ)}


@server.tool()
def load_image(data_base64: str) -> dict:
    """Receives an image's bytes and returns an id for it."""
    data = base64.b64decode(data_base64)
    image_id = "img_site" + hashlib.sha256(data).hexdigest()[:12]
    UPLOADS[image_id] = data
    return {"id": image_id, "bytes": len(data)}


@server.tool()
def image_bytes(image: str) -> str:
    """How many bytes of `image` this server holds (0: it never received its pixels)."""
    return f"{image} holds {len(UPLOADS.get(image, b''))} bytes."


def record(data: bytes) -> None:
    if ARGS.record and data:
        with open(ARGS.record, "ab") as f:
            f.write(data)


def record_stdin() -> None:
    """Puts a pipe in front of fd 0 that copies every byte into the record."""
    original = os.dup(0)
    r, w = os.pipe()
    os.dup2(r, 0)
    os.close(r)

    def pump() -> None:
        while True:
            chunk = os.read(original, 65536)
            if not chunk:
                os.close(w)
                return
            record(chunk)
            os.write(w, chunk)

    threading.Thread(target=pump, daemon=True).start()


class Guard:
    """ASGI middleware: records each request and checks the bearer token."""

    def __init__(self, app, token):
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        head = f"{scope['method']} {scope['path']}\n".encode()
        head += b"".join(k + b": " + v + b"\n" for k, v in scope["headers"])
        record(head)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode()
        if self.token and auth != f"Bearer {self.token}":
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error":"invalid token"}'})
            return

        async def recorded():
            message = await receive()
            if message["type"] == "http.request":
                record(message.get("body", b""))
            return message

        await self.app(scope, recorded, send)


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--http", type=int)
    p.add_argument("--token")
    p.add_argument("--record")
    p.add_argument("--pid-file")
    p.add_argument("--broken-schema", action="store_true")
    ARGS = p.parse_args()
    if ARGS.broken_schema:
        @server.tool()
        def broken_schema(x: str) -> str:
            """A tool whose declared schema is not valid JSON Schema."""
            return x

        server._tool_manager.get_tool("broken_schema").parameters = {
            "type": "object", "properties": {"x": {"type": "no-such-type"}}}
    if ARGS.http is None:
        record_stdin()
        server.run("stdio")
        return
    import uvicorn
    app = Guard(server.streamable_http_app(), ARGS.token)
    uvicorn.run(app, host="127.0.0.1", port=ARGS.http, log_level="warning")


if __name__ == "__main__":
    main()
