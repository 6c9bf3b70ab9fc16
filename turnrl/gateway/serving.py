"""A gateway served over HTTP inside the running event loop (uvicorn): on a free loopback port
beside the rollout engine a harness shares with its training run, or at a configured address by
``turnrl gateway``, which leaves Ctrl-C and SIGTERM to uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from turnrl.gateway.routes import make_app
from turnrl.gateway.server import Gateway


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to the run it serves inside (Ctrl-C stops the run)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _QuietCancellations(logging.Filter):
    """Drops uvicorn's report of a call cancelled because the run is stopping: on Ctrl-C the loop
    cancels every task, and uvicorn logged each call in flight as an error with two tracebacks (24 of
    them for one step of a harness run). The run says itself that it stopped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


_QUIET = _QuietCancellations()


class GatewayServer:
    """A started server: its base URL and port, and ``close``."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], url: str, port: int) -> None:
        self.server, self.task, self.url, self.port = server, task, url, port

    async def close(self) -> None:
        """Stop serving."""
        self.server.should_exit = True
        await asyncio.gather(self.task, return_exceptions=True)


async def serve(
    gateway: Gateway,
    host: str = "127.0.0.1",
    port: int = 0,
    unix: Path | None = None,
    signals: bool = False,
    app: FastAPI | None = None,
) -> GatewayServer:
    """Serve ``gateway`` at ``host``:``port`` (0: a free port) in this loop (and on the Unix socket
    ``unix``, which sandboxed runs reach it by); returns once it listens. ``signals``: Ctrl-C and
    SIGTERM stop the server (else they are the run's it serves inside). ``app``: the routes to serve
    (default: ``make_app(gateway)``)."""
    config = uvicorn.Config(app or make_app(gateway), host, port, log_level="warning", lifespan="off")
    logging.getLogger("uvicorn.error").addFilter(_QUIET)  # no-op when it is there already
    server = uvicorn.Server(config) if signals else _Server(config)
    try:
        listening = socket.create_server((host, port))
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise OSError(exc.errno, f"the gateway cannot listen at {host}:{port}: {why}") from None
    sockets = [listening]
    if unix is not None:
        at_unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        at_unix.bind(str(unix))  # in a folder of turnrl's own: no other user finds it
        at_unix.listen(128)
        sockets.append(at_unix)
    task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if task.done():
            await task  # raises why it could not start
            raise RuntimeError("the gateway stopped before it listened")
        await asyncio.sleep(0.02)
    port = listening.getsockname()[1]
    return GatewayServer(server, task, f"http://{host}:{port}", port)
