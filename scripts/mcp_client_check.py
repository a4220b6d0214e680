#!/usr/bin/env python3
"""Checks Hilum's MCP server with the official MCP Python SDK (a client we did not write).

It lists the tools, loads a real radiograph, calls `image_info` on it and checks the
structured result against the PNG header of the file.

  stdio: scripts/.venv-mcp/bin/python scripts/mcp_client_check.py stdio --hilum target/debug/hilum --image IMG.png
  http:  scripts/.venv-mcp/bin/python scripts/mcp_client_check.py http --url http://127.0.0.1:8080/mcp --token TOKEN --image IMG.png

Prints one JSON line with what it saw; exits 1 on any mismatch.
"""

import argparse
import asyncio
import base64
import json
import struct
import sys

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


def png_size(data: bytes):
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return struct.unpack(">II", data[16:24])


def fail(msg: str):
    print(json.dumps({"ok": False, "error": msg}))
    sys.exit(1)


async def exercise(session: ClientSession, image_path: str, by_path: bool):
    await session.initialize()
    listed = await session.list_tools()
    names = [t.name for t in listed.tools]
    for required in ("load_image", "image_info"):
        if required not in names:
            fail(f"tool {required} missing from tools/list: {names}")
    schema = next(t.input_schema for t in listed.tools if t.name == "image_info")
    if "image" not in schema.get("properties", {}):
        fail(f"image_info schema has no `image` property: {schema}")

    data = open(image_path, "rb").read()
    if by_path:
        args = {"path": image_path}
    else:
        args = {"data_base64": base64.b64encode(data).decode()}
    loaded = await session.call_tool("load_image", args)
    if loaded.is_error:
        fail(f"load_image failed: {loaded.content}")
    image_id = loaded.structured_content["id"]

    info = await session.call_tool("image_info", {"image": image_id})
    if info.is_error:
        fail(f"image_info failed: {info.content}")
    sc = info.structured_content or {}
    expected = png_size(data)
    if expected and (sc.get("width"), sc.get("height")) != expected:
        fail(f"image_info says {sc.get('width')}x{sc.get('height')}, the PNG header says {expected}")
    texts = [c.text for c in info.content if getattr(c, "type", "") == "text"]

    bad = await session.call_tool("image_info", {"image": "img_000000000000"})
    if not bad.is_error:
        fail("an unknown image id must give a tool error")

    return {"ok": True, "tools": names, "image": image_id,
            "width": sc.get("width"), "height": sc.get("height"), "summary": texts[:1]}


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["stdio", "http"])
    ap.add_argument("--hilum", help="path of the hilum binary, or of hilum-mcp (stdio)")
    ap.add_argument("--url", help="MCP endpoint (http)")
    ap.add_argument("--token", help="bearer token (http)")
    ap.add_argument("--image", required=True)
    a = ap.parse_args()
    if a.mode == "stdio":
        # `hilum mcp`, or the standalone `hilum-mcp` binary of hilum-server.
        args = [] if a.hilum.endswith("hilum-mcp") else ["mcp"]
        params = StdioServerParameters(command=a.hilum, args=args)
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                result = await exercise(session, a.image, by_path=True)
    else:
        client = create_mcp_http_client(headers={"Authorization": f"Bearer {a.token}"})
        async with client:
            async with streamable_http_client(a.url, http_client=client) as (read, write):
                async with ClientSession(read, write) as session:
                    result = await exercise(session, a.image, by_path=False)
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
