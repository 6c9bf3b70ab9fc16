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

``python -c SERVE [--path FOLDER]... MODULE...`` (SERVE imports this module's ``main`` and calls
it, rather than ``-m``, which would run this module twice: as ``__main__`` and as imported by
``turnrl.harness``; FOLDER: where else a module may be, for its import only; a "module:function" is
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
import gc
import importlib
import io
import json
import os
import select
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from turnrl.harness.keeper import keep_forked, reaped
from turnrl.harness.namespaces import enter
from turnrl.support.errors import describe


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
            with contextlib.suppress(ProcessLookupError, PermissionError):
                (os.killpg if group else os.kill)(pid, sig)
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


# The server's side (its own process).

SERVE = "from turnrl.harness.forkserver import main; main()"

_PROTOCOL = 1  # the fd the server speaks on: stdout's own, moved aside so that imports cannot print on it


def _say(message: dict[str, Any]) -> None:
    os.write(_PROTOCOL, json.dumps(message).encode() + b"\n")


def _serve() -> dict[str, Any]:
    """Fork a run per request until stdin closes (then exit); in a fork, return its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap()
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 20)
        if not data:
            _reap()
            sys.exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "kill" in request:  # a signal for a run, sent from here: its pid is of this namespace
                with contextlib.suppress(OSError):
                    (os.killpg if request.get("group") else os.kill)(request["kill"], request["signal"])
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            # what the server holds goes to the collector's permanent generation, so the run's
            # collections skip it and leave its pages shared (Python's advice for fork servers)
            gc.freeze()
            try:
                pid = os.fork()
            except OSError as exc:
                _say({"id": request["id"], "error": f"cannot fork: {exc.strerror or exc}"})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w, _PROTOCOL):
                    os.close(fd)
                return dict(request)
            _say({"id": request["id"], "pid": pid})


def _reap() -> None:
    """Report every run that has exited."""
    for pid, code in reaped():
        _say({"pid": pid, "code": code})


def _become(request: dict[str, Any]) -> None:
    """In the fork: turn into the run ``request`` describes, then run it as ``python`` would."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    argv = request["argv"]
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.path[0:1] = [os.getcwd(), *extra]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[0:1] = [os.path.dirname(os.path.abspath(argv[1])), *extra]
        runpy.run_path(argv[1], run_name="__main__")


def main() -> None:
    """Import the modules named on the command line, say ready, and serve."""
    global _PROTOCOL
    _PROTOCOL = os.dup(1)
    os.dup2(2, 1)  # what the server or an import prints goes to stderr
    args, search = sys.argv[1:], []
    while args[:1] == ["--path"]:
        search.append(args[1])
        args = args[2:]
    sys.path.extend(search)
    for name in args:
        module, _, function = name.partition(":")
        try:
            imported = importlib.import_module(module)
            if function:  # a warm-up, called once
                getattr(imported, function)()
        except Exception as exc:  # any failure is one line
            did = "failed" if function else "did not import"
            _say({"error": f"env.preload: {name!r} {did}: {describe(exc)}"})
            sys.exit(2)
    for folder in search:  # a run's own sys.path is a new process's
        sys.path.remove(folder)
    _say({"ready": True})
    request = _serve()
    os.setsid()  # the run's own session, led by its keeper: the run is forked once more below it
    _redirect(request)
    bridge = None
    if "sandbox" in request:
        try:
            listener = enter(request["sandbox"])  # from here on: the run's init, in its sandbox
        except OSError as exc:
            print(f"cannot start the run: {exc}", file=sys.stderr, flush=True)
            os._exit(126)
        if listener is not None:
            bridge = (listener, str(request["sandbox"]["bridge"][1]))
    keep_forked(lambda: _run(request), bridge)


def _redirect(request: dict[str, Any]) -> None:
    """The run's standard streams: stdin from /dev/null, stdout and stderr to its files (opened
    before its sandbox hides where they are)."""
    for fd, path, mode in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_APPEND),
        (2, request["stderr"], os.O_WRONLY | os.O_APPEND),
    ):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)


def _run(request: dict[str, Any]) -> int:
    """In the fork: the run, then its exit status as ``python`` would give it."""
    code = 0
    try:
        _become(request)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # the traceback python prints, from the agent's own frames
        tb = _agents_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    code = _finish(code)
    if code == -signal.SIGINT:  # python ends by the signal itself, as the shell expects
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _agents_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without the fork server's and runpy's frames above the agent's."""
    import runpy

    ours = {_become.__code__.co_filename, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def _exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives: 0 for None, the number, else 1 after printing it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> int:
    """What an interpreter does at exit, short of freeing every object: that would touch every page
    the run shares with the server, copying them all (two thirds of a forked run's CPU for an agent
    on the openai SDK). Threads are joined, ``atexit`` functions run, the files the run left open
    are closed (their buffers written) and the standard streams flushed."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException as exc:  # a join interrupted: go on exiting, as python does
        sys.excepthook(type(exc), exc, exc.__traceback__)
    atexit._run_exitfuncs()
    _close_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone
            code = code or 120  # python's status when its streams cannot be flushed at exit
    return code


def _close_files() -> None:
    """Close the files the run opened and left open, wrappers before what they wrap, as the
    interpreter's last collection would. Only the run's own objects are looked at: those the
    server held are frozen (``gc.freeze`` before the fork), out of the generations searched."""
    gc.collect()  # the run's unreachable cycles, files among them, finalized now
    standard = {
        id(s) for s in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__)
    }
    files = [
        obj
        for generation in range(3)
        for obj in gc.get_objects(generation)
        if isinstance(obj, io.IOBase) and id(obj) not in standard
    ]
    for file in sorted(files, key=_layer):
        with contextlib.suppress(Exception):
            file.close()


def _layer(file: io.IOBase) -> int:
    """0 for a wrapper written in Python (a gzip file), 1 text, 2 buffered, 3 raw."""
    if isinstance(file, io.TextIOWrapper):
        return 1
    if isinstance(file, (io.BufferedWriter, io.BufferedRandom, io.BufferedReader, io.BufferedRWPair)):
        return 2
    if isinstance(file, io.FileIO):
        return 3
    return 0


if __name__ == "__main__":
    main()
