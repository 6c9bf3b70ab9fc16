"""A small MCP server for the tests, on the official SDK: ``python mcp_server.py stdio`` or
``python mcp_server.py http PORT``. Its tools add, look up keys, fail, sleep, draw, and crash."""

from __future__ import annotations

import asyncio
import io
import os
import sys

try:  # mcp 2.x
    from mcp.server.mcpserver import Image, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer  # type: ignore[no-redef]
    from mcp.server.fastmcp import Image  # type: ignore[no-redef]
    from mcp.server.fastmcp.exceptions import ToolError  # type: ignore[no-redef]

if os.environ.get("MCP_TEST_FAIL_AT_START"):
    sys.exit(f"cannot start: {os.environ['MCP_TEST_FAIL_AT_START']}")

server = MCPServer("turnrl-test")
STORE = {"alpha": "17", "beta": "23"}


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def lookup(key: str) -> str:
    """The value stored under a key."""
    if key not in STORE:
        raise ToolError(f"no key {key!r}; keys: {', '.join(STORE)}")
    return STORE[key]


@server.tool()
async def slow(seconds: float) -> str:
    """Wait, then answer."""
    await asyncio.sleep(seconds)
    return f"waited {seconds}"


@server.tool()
def square(size: int) -> Image:
    """A red square as a PNG image."""
    from PIL import Image as PILImage

    buffer = io.BytesIO()
    PILImage.new("RGB", (size, size), (255, 0, 0)).save(buffer, format="PNG")
    return Image(data=buffer.getvalue(), format="png")


@server.tool()
def crash() -> str:
    """Kill the server process mid-call."""
    print("crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


if __name__ == "__main__":
    if sys.argv[1] == "http":
        asyncio.run(server.run_streamable_http_async(host="127.0.0.1", port=int(sys.argv[2])))
    else:
        server.run("stdio")
