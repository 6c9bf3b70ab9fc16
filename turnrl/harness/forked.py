"""The fork server's own process (``turnrl.harness.forkserver`` has its client and the protocol):
it imports the modules of ``env.preload`` once, says ready, then forks a run per request, each
turned into what a new ``python`` would be (a sandbox of its own first, when the server runs in
one: ``turnrl.harness.namespaces``) and ended as ``python`` ends.

Ending as ``python`` does, short of freeing every object, calls two functions the interpreter's own
exit calls and that have no public name: ``threading._shutdown`` (join non-daemon threads) and
``atexit._run_exitfuncs``; both have been stable since Python 3.4."""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import os
import select
import signal
import sys
from types import TracebackType
from typing import Any

from turnrl.harness.keeper import keep_forked, reaped, signal_process
from turnrl.harness.namespaces import can_enter, enter
from turnrl.support.errors import describe

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
                signal_process(request["kill"], request["signal"], bool(request.get("group")))
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
    sandboxed = args[:1] == ["--sandboxed"]
    args = args[1:] if sandboxed else args
    while args[:1] == ["--path"]:
        search.append(args[1])
        args = args[2:]
    if sandboxed and (why := can_enter()):  # before any import: one line, not a failure per run
        _say({"error": f"{why}; drop env.preload (sandboxed runs then start as new processes)"})
        sys.exit(2)
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
