"""A fork server for harness runs of Python agents: one process imports the modules of ``env.preload``
once, then forks each run from that warm state, so a run does not pay their import time (the openai
SDK alone costs ~0.7 s of CPU per process).

A forked run is what a fresh ``python`` would be, as far as the agent can tell: a session (a process
group) of its own, its own folder as working directory, its own variables (``os.environ``), its own
stdin (/dev/null), stdout and stderr files, ``sys.argv`` and ``sys.path[0]``, and exit code. It ends
as ``python`` does (threads joined, ``atexit`` functions run, files left open written and closed, the
same status and traceback) without freeing every object one by one, which would copy every page it
shares with the server. The fork the server reports is the run's keeper (``turnrl.harness.keeper``):
it forks the run once more and, when the run ends (or on SIGTERM), kills whatever it left behind.
What it shares with the server is what was imported before the fork, so a
preloaded module must not read the run's variables at import time (it saw turnrl's).

The server is its own program, ``turnrl.harness.forked``; this module is turnrl's side. ``python
-c SERVE [--sandboxed] [--path FOLDER]... MODULE...`` (``--sandboxed``: the server checks it can
make a run's namespaces before it imports anything; SERVE imports ``turnrl.harness.forked.main`` and calls it,
rather than ``-m``, which would run that module twice: as ``__main__`` and as imported; FOLDER:
where else a module may be, for its import only; a "module:function" is
imported and called once, a warm-up) speaks JSON lines. On stdin: one request per run (``{"id",
"argv", "cwd", "env", "stdout", "stderr"}`` and, for a sandboxed server, ``"sandbox"``; argv being
``[python, script, ...]`` or ``[python, -m, module, ...]``), or a signal for a run (``{"kill": pid,
"signal", "group"}``: a sandboxed server's pids are of its own PID namespace, not turnrl's). On
stdout: ``{"ready": true}`` (or ``{"error": ...}``: a module did not import) once, then ``{"id",
"pid"}`` per fork and ``{"pid", "code"}`` when a run exits (a negative code: killed by that
signal). ``ForkServer`` is its asyncio client in turnrl.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from turnrl.harness.keeper import signal_process


def forkable(argv: list[str]) -> list[str] | None:
    """``argv`` as ``[python, script, ...]`` or ``[python, -m, module, ...]`` when it runs this
    interpreter on a script or module (a console script whose ``#!`` names this interpreter, such
    as an agent's CLI installed beside turnrl, counts), which a fork of the server can run; else None."""
    if argv and argv[0] != sys.executable and _shebang(argv[0]) == sys.executable:
        argv = [sys.executable, *argv]
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] == "-m":
        return argv if len(argv) >= 3 else None
    return argv if not argv[1].startswith("-") and os.path.isfile(argv[1]) else None


def _shebang(path: str) -> str | None:
    """The interpreter a script's ``#!`` line names (None: not a readable script)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    return first[2:].decode("utf-8", "replace").strip() if first.startswith(b"#!") else None


class ForkServer:
    """turnrl's side: starts the server on first use, forks runs through it, waits for their exits."""

    def __init__(
        self,
        preload: list[str],
        search: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        sandbox: Callable[[], list[str]] | None = None,
    ) -> None:
        self.preload = preload
        self.search = list(search)  # folders the preloaded modules may be in (as turnrl's hooks)
        self.env = dict(env) if env is not None else None  # the server's variables (None: turnrl's)
        self.sandbox = sandbox  # the argv that starts the server in its sandbox (its runs enter their own)
        self._proc: asyncio.subprocess.Process | None = None
        self.pid: int | None = None  # the server's process, once started
        self._reader: asyncio.Task[None] | None = None
        self._started: asyncio.Future[None] | None = None
        self._spawned: dict[int, asyncio.Future[int]] = {}  # request id -> pid
        self._exits: dict[int, asyncio.Future[int]] = {}  # pid -> exit code
        self._ids = 0
        self._lock = asyncio.Lock()

    async def spawn(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        stdout: str,
        stderr: str,
        sandbox: dict[str, Any] | None = None,
    ) -> int:
        """Fork a run of ``argv`` (see ``forkable``), in the sandbox ``sandbox`` describes
        (``turnrl.harness.namespaces``) when the server runs in one; its pid, which leads its own
        process group. Raises OSError when the server cannot start or a preloaded module does not
        import."""
        await self._start()
        assert self._proc is not None and self._proc.stdin is not None
        self._ids += 1
        spawned = self._spawned[self._ids] = asyncio.get_running_loop().create_future()
        request = {"id": self._ids, "argv": argv, "cwd": cwd, "env": env, "stdout": stdout, "stderr": stderr}
        if sandbox is not None:
            request["sandbox"] = sandbox
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        await self._proc.stdin.drain()
        pid = await spawned
        self._exits.setdefault(pid, asyncio.get_running_loop().create_future())
        return pid

    def kill(self, pid: int, sig: int, group: bool = False) -> None:
        """Send ``sig`` to the run ``pid`` (``group``: to its whole process group). A sandboxed
        server's pids are of its own PID namespace, so it sends the signal itself; gone: no-op."""
        if self.sandbox is None:
            signal_process(pid, sig, group)
            return
        proc = self._proc
        if proc is not None and proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.write(json.dumps({"kill": pid, "signal": int(sig), "group": group}).encode() + b"\n")

    async def wait(self, pid: int) -> int:
        """The exit code of the run ``pid`` (negative: the signal that killed it); cancelling the
        wait (a timeout) leaves the run to be waited for again."""
        exit = self._exits.setdefault(pid, asyncio.get_running_loop().create_future())
        code = await asyncio.shield(exit)
        self._exits.pop(pid, None)
        return code

    async def close(self) -> None:
        """Stop the server (runs still going are the caller's to kill)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        if self._reader is not None:
            await self._reader
        self._started = None

    async def _start(self) -> None:
        async with self._lock:
            if self._proc is not None and self._proc.returncode is None and self._started is not None:
                await self._started
                return
            self._started = asyncio.get_running_loop().create_future()
            self._proc = await asyncio.create_subprocess_exec(
                *(self.sandbox() if self.sandbox is not None else []),
                sys.executable,
                "-c",
                SERVE,
                *(["--sandboxed"] if self.sandbox is not None else []),
                *[arg for folder in self.search for arg in ("--path", folder)],
                *self.preload,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=self.env,
                limit=2**20,
            )
            self.pid = self._proc.pid
            self._reader = asyncio.create_task(self._read(self._proc, self._started))
            await self._started

    async def _read(self, proc: asyncio.subprocess.Process, started: asyncio.Future[None]) -> None:
        """Route the server's lines to the futures waiting on them; when it ends, fail what waits."""
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            message: dict[str, Any] = json.loads(line)
            if "ready" in message:
                started.set_result(None)
            elif "error" in message and not started.done():
                started.set_exception(OSError(message["error"]))
            elif "id" in message:
                spawned = self._spawned.pop(int(message["id"]))
                if "pid" in message:
                    spawned.set_result(int(message["pid"]))
                else:
                    spawned.set_exception(OSError(message.get("error", "the fork failed")))
            else:
                exit = self._exits.setdefault(int(message["pid"]), asyncio.get_running_loop().create_future())
                if not exit.done():
                    exit.set_result(int(message["code"]))
        code = await proc.wait()
        gone = OSError(f"the harness fork server (env.preload) ended with code {code}")
        if not started.done():
            started.set_exception(gone)
        for future in [*self._spawned.values(), *self._exits.values()]:
            if not future.done():
                future.set_exception(gone)
        self._spawned.clear()
        for pid in [pid for pid, future in self._exits.items() if future.done()]:
            del self._exits[pid]


SERVE = "from turnrl.harness.forked import main; main()"  # the server's program (turnrl.harness.forked)
