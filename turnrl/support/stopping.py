"""Every stop is bounded: a Ctrl-C (or SIGTERM, which the CLI turns into one) that has not ended the
run within a grace period is repeated as a KeyboardInterrupt in the main thread (saying where the
tasks still running wait), and when that has not ended it either, the process prints every thread's
stack and exits 130.

asyncio's own handler turns the first Ctrl-C into a cancellation of the running command, so that it
stops cleanly (servers stopped, files closed). A cancellation can be lost (a task that swallows it)
or a clean-up can wait on a thread that waits on the loop; then nothing else would stop the run.
``bounded_stops`` wraps the handler asyncio installed while a command's coroutine runs.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from types import FrameType
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

GRACE_S = 20.0  # after the signal, before it is repeated; as long again before the process exits
_enforced = False  # only the CLI forces stops (a library user's process is theirs)
_handled = 0.0  # when a stop signal's Python handler last ran (time.monotonic)
RELAY_WAIT_S = 0.5  # a signal whose handler has not run this long after it arrived is sent again
_hint: Callable[[], str | None] = lambda: None  # noqa: E731 - the command that continues the run


def enforce(hint: Callable[[], str | None] | None = None) -> None:
    """Force stops that do not finish (the CLI's processes; see the module); ``hint``: the command
    that continues the run, said when the process is made to exit."""
    global _enforced, _hint
    if not _enforced and threading.current_thread() is threading.main_thread():
        _relay_signals()
    _enforced = True
    if hint is not None:
        _hint = hint


def handled() -> None:
    """Say that a stop signal's handler ran (the relay then has nothing to send again)."""
    global _handled
    _handled = time.monotonic()


def _relay_signals() -> None:
    """Python runs a signal's handler in the main thread, at its next instruction; a signal the
    kernel gave another thread (torch's, a server's) while the main thread blocks in a call that is
    not interrupted (``time.sleep`` inside an ``async def``) is never handled. The relay reads the
    signals off the interpreter's wakeup fd and, when a SIGTERM has not been handled shortly after
    (the CLI's handler says ``handled``), sends it again to the main thread itself, whose blocking
    call it interrupts."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: leave it
        os.close(read)
        os.close(write)
        return
    main = threading.main_thread().ident

    def relay() -> None:
        while data := os.read(read, 64):
            arrived = time.monotonic()
            if int(signal.SIGTERM) in data:
                time.sleep(RELAY_WAIT_S)
                if _handled < arrived and main is not None:
                    signal.pthread_kill(main, signal.SIGTERM)

    threading.Thread(target=relay, name="turnrl-signal-relay", daemon=True).start()


class _Bounded:
    """A SIGINT handler: the one it wraps, and a watch that bounds how long the stop takes."""

    def __init__(self, inner: Any, grace_s: float, loop: asyncio.AbstractEventLoop) -> None:
        self.inner, self.grace_s, self.loop = inner, grace_s, loop
        self.watching = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        handled()
        if not self.watching:
            self.watching = True
            threading.Thread(target=self._watch, name="turnrl-stop-watch", daemon=True).start()
        self.inner(signum, frame)

    def _watch(self) -> None:
        time.sleep(self.grace_s)
        print(
            f"turnrl: still stopping {self.grace_s:g} s after the signal; interrupting again", file=sys.stderr
        )
        for line in _waiting_tasks(self.loop):  # what holds the stop (the threads' stacks show only the loop)
            print(f"turnrl:   {line}", file=sys.stderr)
        main = threading.main_thread().ident
        if main is not None:  # a real signal wakes a main thread that waits in a system call
            signal.pthread_kill(main, signal.SIGINT)  # the wrapped handler's second: KeyboardInterrupt
        time.sleep(self.grace_s)
        hint = _hint()
        print(
            f"turnrl: did not stop within {2 * self.grace_s:g} s of the signal; exiting (130). "
            "What finished is on disk" + (f"; continue with: {hint}" if hint else "") + ".",
            file=sys.stderr,
        )
        print("turnrl: the threads still running:", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(130)


def _waiting_tasks(loop: asyncio.AbstractEventLoop, limit: int = 10) -> list[str]:
    """The tasks of ``loop`` not done yet, counted by where each waits (its innermost coroutine's
    line), most first; read from another thread while the loop waits, so best effort."""
    try:
        tasks = asyncio.all_tasks(loop)  # it reads again itself when the set changes meanwhile
    except RuntimeError:
        return []
    places = Counter(_where(task) for task in tasks)
    lines = [f"{n} task{'s' * (n > 1)} waiting at {place}" for place, n in places.most_common(limit)]
    if len(places) > limit:
        lines.append(f"and {len(places) - limit} more places")
    return lines


_ASYNCIO = os.path.dirname(asyncio.__file__)


def _where(task: asyncio.Task[Any]) -> str:
    """Where ``task`` waits: the file, line and function of its innermost coroutine outside asyncio."""
    coro: Any = task.get_coro()
    frame = None
    while coro is not None:
        inner = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if inner is None:
            break
        if not inner.f_code.co_filename.startswith(_ASYNCIO):  # asyncio.sleep's own frame says little
            frame = inner
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    if frame is None:
        return repr(task.get_coro())
    path = "/".join(frame.f_code.co_filename.split(os.sep)[-3:])
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_qualname}"


def bounded_stops(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Decorate a command's coroutine: while it runs (inside ``asyncio.run``), the SIGINT handler
    asyncio installed is wrapped so that a stop that does not finish is forced (see the module); it
    is put back when the coroutine returns. Unless ``enforce`` was called (the CLI), outside the
    main thread, or when SIGINT is ignored, nothing changes."""

    @functools.wraps(fn)
    async def run(*args: P.args, **kwargs: P.kwargs) -> T:
        current = signal.getsignal(signal.SIGINT)
        main = threading.current_thread() is threading.main_thread()
        if not _enforced or not main or not callable(current) or isinstance(current, _Bounded):
            return await fn(*args, **kwargs)
        bounded = _Bounded(current, GRACE_S, asyncio.get_running_loop())
        signal.signal(signal.SIGINT, bounded)
        try:
            return await fn(*args, **kwargs)
        finally:
            if signal.getsignal(signal.SIGINT) is bounded:
                signal.signal(signal.SIGINT, current)

    return run
