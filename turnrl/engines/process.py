"""A server process turnrl starts and owns: loopback port, log file, health wait, clean stop.

Each process runs in its own session (process group), so stopping it stops what it spawned
(vLLM's engine core, for one); it also gets SIGTERM when the process that started it dies
(Linux ``PR_SET_PDEATHSIG``), and every process still running when Python exits is stopped, so
a crash or a Ctrl-C leaves no orphan server behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import httpx

from turnrl.types import EngineError

_LIVE: set[ServerProcess] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child (before exec, or first thing): ``sig`` when the parent dies (Linux only; elsewhere
    a no-op). The parent is the thread that started the child: start children from one that lasts."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


class ServerProcess:
    """One server process on 127.0.0.1; subclasses give its ``command`` and ``name``."""

    name = "server"
    health_path = "/health"

    def __init__(self, *, port: int | None = None, log_path: str | Path | None = None) -> None:
        """Describe the process; nothing runs until :meth:`start`. A taken ``port`` is refused there."""
        self.port = port or free_port()
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """The server root, ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the server."""
        raise NotImplementedError

    def environment(self) -> Mapping[str, str] | None:
        """The process environment (None: this process's)."""
        return None

    def launch(self) -> Self:
        """Start the process without waiting for it to be ready."""
        if self.alive():
            return self
        if port_in_use(self.port):
            raise EngineError(f"{self.name}: port {self.port} on 127.0.0.1 is already in use")
        self._close_log()
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        out = self._log or subprocess.DEVNULL
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=self.environment(),
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        _LIVE.add(self)
        return self

    def start(self, timeout_s: float = 60.0, on_wait: Callable[[float], None] | None = None) -> Self:
        """Start the process and wait until its health check answers 200."""
        self.launch()
        try:
            self.wait_ready(timeout_s, on_wait)
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """Kill the process and its group at once (SIGKILL), as a crash would."""
        self._signal(signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
            _wait_group_gone(self.process.pid, timeout_s=5.0)
        self._forget()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Ask the process group to end (SIGTERM), kill it if it does not; close the log."""
        if self.alive():
            self._signal(signal.SIGTERM)
            assert self.process is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_s)
        self._signal(signal.SIGKILL)  # whatever of the group is left
        if self.process is not None:
            _wait_group_gone(self.process.pid, timeout_s=5.0)
        self._forget()

    def _signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process group (the process's own session)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def _forget(self) -> None:
        _LIVE.discard(self)
        self._close_log()

    def _close_log(self) -> None:
        """Close the log file, if one is open."""
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float, on_wait: Callable[[float], None] | None = None) -> None:
        """Poll the health path until 200; fail early, with the log's last lines, if the process exits."""
        start = time.monotonic()
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while (waited := time.monotonic() - start) < timeout_s:
                if not self.alive():
                    code = self.process.returncode if self.process else None
                    raise EngineError(f"{self.name} exited with code {code} while starting{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}{self.health_path}").status_code == 200:
                        return
                if on_wait is not None:
                    on_wait(waited)
                time.sleep(0.25)
        raise EngineError(f"{self.name} not ready after {timeout_s:g}s{self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        """`` (log PATH: last lines)`` for an error message, or a hint when there is no log."""
        if self.log_path is None:
            return " (pass log_path to keep its log)"
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return f" (log: {self.log_path})"
        tail = " | ".join(line.strip() for line in text[-lines:] if line.strip())
        return f" (log {self.log_path}: {tail})"


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no process of group ``pgid`` runs (zombies aside), at most ``timeout_s``: a killed
    group's other members (not our children) die a moment after the signal. Linux only (reads /proc)."""
    deadline = time.monotonic() + timeout_s
    while _group_running(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is running (not a zombie); False where /proc is absent."""
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # after the command's parenthesised name: state, ppid, pgrp
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def stop_all() -> None:
    """Stop every server process this Python process started and has not stopped."""
    for server in list(_LIVE):
        server.stop(timeout_s=5.0)


atexit.register(stop_all)


def launch_all(
    servers: Sequence[ServerProcess], timeout_s: float, on_wait: Callable[[float], None] | None
) -> None:
    """Start ``servers`` together and wait for all; on any failure stop every one of them."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(timeout_s, on_wait)
    except BaseException:
        for server in servers:
            server.stop()
        raise
