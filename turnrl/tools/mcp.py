"""Tools served by MCP servers (the official ``mcp`` SDK), over stdio or streamable HTTP.

Each server is one connection owned by a background thread with its own event loop, opened when
the tools are loaded (so their schemas are known before any env is built) and shared by every
trajectory; a call from any event loop is handed to it. Tool schemas become OpenAI function
schemas; a call's text parts become the tool message (image parts its images); an error result,
a timeout, or a server that died mid-call become tool errors for the model. A dead server is
restarted on the next call (up to ``max_restarts`` times).

Servers are given as in Claude Desktop's and verl's ``mcp_servers`` JSON:
``{"name": {"command": "python", "args": ["server.py"], "env": {...}}}`` or ``{"name": {"url": ...}}``.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import contextlib
import io
import json
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.support.errors import describe
from turnrl.tools.base import BaseTool, ToolError, ToolOutput, ToolSchema
from turnrl.tools.files import read_data_file


class MCPError(RuntimeError):
    """An MCP server that cannot be reached or started; the message names it and says why."""


@dataclass
class MCPServerSpec:
    """How to reach one MCP server: a command to start (stdio) or a URL (streamable HTTP)."""

    name: str
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None

    @classmethod
    def from_dict(cls, name: str, raw: Mapping[str, Any]) -> MCPServerSpec:
        """One entry of an ``mcpServers`` mapping."""
        if not isinstance(raw, Mapping) or bool(raw.get("command")) == bool(raw.get("url")):
            raise MCPError(f"MCP server {name!r} needs exactly one of 'command' (stdio) and 'url' (HTTP)")
        return cls(
            name=name,
            command=raw.get("command"),
            args=[str(a) for a in raw.get("args") or []],
            env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
            cwd=raw.get("cwd"),
            url=raw.get("url"),
        )

    def describe(self) -> str:
        return self.url or " ".join([self.command or "", *self.args])


def read_servers(source: str | os.PathLike[str] | Mapping[str, Any]) -> list[MCPServerSpec]:
    """Servers from an ``{"mcpServers": {...}}`` JSON file (or its mapping), or a bare name mapping."""
    data = read_data_file(source, "MCP servers file", MCPError)
    servers = data.get("mcpServers", data) if isinstance(data, Mapping) else None
    if not isinstance(servers, Mapping) or not servers:
        raise MCPError("MCP servers: expected a mapping of server names (mcpServers)")
    return [MCPServerSpec.from_dict(str(name), raw) for name, raw in servers.items()]


class MCPConnection:
    """One live session with an MCP server, owned by a background thread's event loop."""

    def __init__(self, spec: MCPServerSpec, start_timeout_s: float = 60.0, max_restarts: int = 3) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{spec.name}", daemon=True)
        self._thread.start()
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._served: concurrent.futures.Future[None] | None = None
        self._errlog = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (the server's stderr, closed in close)
        self._lock = threading.Lock()

    def start(self) -> list[Any]:
        """Connect (start the server process for stdio), initialize, and list the server's tools."""
        ready: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self._served = asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        try:
            return ready.result(self.start_timeout_s)
        except concurrent.futures.TimeoutError:
            self._shutdown()
            raise MCPError(self._failed(f"did not answer within {self.start_timeout_s:g} s")) from None
        except Exception as exc:
            self._shutdown()
            raise MCPError(self._failed(_reason(exc))) from None

    @property
    def alive(self) -> bool:
        """Whether the session is up."""
        return self._served is not None and not self._served.done() and self._session is not None

    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float | None) -> Any:
        """Call a tool from any event loop; a dead server is restarted first (within the budget)."""
        if not self.alive:
            await asyncio.to_thread(self._restart)
        future = asyncio.run_coroutine_threadsafe(self._call(name, arguments, timeout_s), self._loop)
        try:
            return await asyncio.wrap_future(future)
        except Exception as exc:
            if _closed(exc):  # the server went away: end this session; the next call restarts it
                self._session = None
                stop = self._stop
                if stop is not None:
                    self._loop.call_soon_threadsafe(stop.set)
            if not self.alive:
                raise ToolError(self._failed(f"died during the call ({_reason(exc)})")) from None
            raise

    def close(self) -> None:
        """End the session (and the server process) and the thread."""
        self._shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._errlog.close()

    # -- inside the connection's loop ------------------------------------------------------------

    async def _serve(self, ready: concurrent.futures.Future[list[Any]]) -> None:
        from mcp import ClientSession

        self._stop = asyncio.Event()
        try:
            async with contextlib.AsyncExitStack() as stack:
                streams = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                tools = await _list_tools(session)
                self._session = session
                ready.set_result(tools)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._session = None

    def _transport(self) -> contextlib.AbstractAsyncContextManager[Any]:
        if self.spec.url:
            from mcp.client import streamable_http

            names = ("streamable_http_client", "streamablehttp_client")  # mcp 2.x, 1.x
            client = next(getattr(streamable_http, n) for n in names if hasattr(streamable_http, n))
            return client(self.spec.url)
        from mcp.client.stdio import StdioServerParameters, stdio_client

        env = {**os.environ, **self.spec.env}
        params = StdioServerParameters(
            command=self.spec.command or "", args=self.spec.args, env=env, cwd=self.spec.cwd
        )
        return stdio_client(params, errlog=self._errlog)

    async def _call(self, name: str, arguments: dict[str, Any], timeout_s: float | None) -> Any:
        session = self._session
        if session is None:
            raise ToolError(self._failed("is not connected"))
        async with asyncio.timeout(timeout_s):
            return await session.call_tool(name, arguments)

    # -- lifecycle helpers ------------------------------------------------------------------------

    def _restart(self) -> None:
        with self._lock:
            if self.alive:
                return
            if self.restarts >= self.max_restarts:
                raise ToolError(self._failed(f"is down and was restarted {self.restarts} times already"))
            self.restarts += 1
            self._shutdown()
            self.start()

    def _shutdown(self) -> None:
        stop, served = self._stop, self._served
        if stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(stop.set)
        if served is not None:
            with contextlib.suppress(Exception):
                served.result(timeout=10)
        self._served = None

    def _failed(self, what: str) -> str:
        """One line: the server, what happened, and the last line of its stderr."""
        tail = ""
        with contextlib.suppress(Exception):
            self._errlog.seek(0)
            lines = [line.strip() for line in self._errlog.read().splitlines() if line.strip()]
            tail = f"; its stderr ends: {lines[-1][:300]}" if lines else ""
        return f"MCP server {self.spec.name!r} ({self.spec.describe()}) {what}{tail}"


async def _list_tools(session: Any) -> list[Any]:
    tools: list[Any] = []
    cursor = None
    while True:
        page = await session.list_tools(cursor=cursor) if cursor else await session.list_tools()
        tools += page.tools
        cursor = _get(page, "next_cursor", "nextCursor")
        if not cursor:
            return tools


def _get(obj: Any, *names: str) -> Any:
    """A field of an MCP type under its 2.x (snake_case) or 1.x (camelCase) name."""
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    return None


def _closed(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection is gone (the server exited or hung up)."""
    import anyio

    gone = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, ConnectionError)
    return isinstance(exc, gone) or "connection closed" in str(exc).lower()


def _reason(exc: BaseException) -> str:
    """An exception as a short reason (an exception group: its first leaf)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return describe(exc) if str(exc) else type(exc).__name__


def function_schema(tool: Any, name: str | None = None) -> ToolSchema:
    """An MCP tool's schema as an OpenAI function schema."""
    parameters = dict(_get(tool, "input_schema", "inputSchema") or {"type": "object", "properties": {}})
    parameters.pop("$schema", None)
    parameters.pop("title", None)  # pydantic's model name ("addArguments"), not for the model
    parameters.setdefault("type", "object")
    return {
        "type": "function",
        "function": {
            "name": name or tool.name,
            "description": tool.description or _get(tool, "title") or tool.name,
            "parameters": parameters,
        },
    }


class MCPTool(BaseTool):
    """One tool of an MCP server, called through the server's shared connection."""

    def __init__(self, connection: MCPConnection, tool: Any, name: str | None = None) -> None:
        super().__init__(tool_schema=function_schema(tool, name))
        self.connection = connection
        self.remote_name = str(tool.name)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolOutput:
        """Call the tool; its text parts are the answer, its image parts the images."""
        result = await self.connection.call(self.remote_name, parameters, kwargs.get("timeout_s"))
        text, images = result_content(result)
        if _get(result, "is_error", "isError"):
            raise ToolError(text or f"tool '{self.remote_name}' failed")
        return ToolOutput(text, images=images, metrics={"mcp_server": self.connection.spec.name})


def result_content(result: Any) -> tuple[str, list[Any]]:
    """An MCP tool result as the tool message's text and images."""
    texts: list[str] = []
    images: list[Any] = []
    for part in result.content or []:
        kind = getattr(part, "type", "")
        if kind == "text":
            texts.append(part.text)
        elif kind == "image":
            images.append(_image(part.data))
        elif kind == "resource":
            resource = part.resource
            texts.append(getattr(resource, "text", None) or f"[resource {resource.uri}]")
        else:
            texts.append(f"[{kind} content]")
    structured = _get(result, "structured_content", "structuredContent")
    if not texts and structured is not None:
        texts.append(json.dumps(structured, ensure_ascii=False))
    return "\n".join(texts), images


def _image(data: str) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


def mcp_tools(
    servers: Sequence[MCPServerSpec],
    select: Sequence[str] | None = None,
    prefix: bool = False,
    start_timeout_s: float = 60.0,
) -> list[MCPTool]:
    """Connect to every server and return their tools (``select``: only these names; ``prefix``:
    names become ``server__tool``, for servers whose tool names clash)."""
    tools: list[MCPTool] = []
    offered: list[str] = []
    for spec in servers:
        connection = MCPConnection(spec, start_timeout_s)
        _OPEN.append(connection)
        for tool in connection.start():
            offered.append(tool.name)
            if select is None or tool.name in select:
                tools.append(MCPTool(connection, tool, f"{spec.name}__{tool.name}" if prefix else None))
    missing = sorted(set(select or ()) - set(offered))
    if missing:
        raise MCPError(
            f"MCP tools {missing} are not offered by the servers (they offer: {', '.join(offered)})"
        )
    return tools


_OPEN: list[MCPConnection] = []  # every connection opened, closed at interpreter exit


@atexit.register
def close_all() -> None:
    """Close every MCP connection (and stop their server processes)."""
    while _OPEN:
        with contextlib.suppress(Exception):
            _OPEN.pop().close()
