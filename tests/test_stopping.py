"""A stop that does not finish is forced (``turnrl.support.stopping``): real processes, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, threading
    from turnrl.support import stopping

    stopping.GRACE_S = 1.0
    stopping.enforce(lambda: "turnrl train x.yaml --resume")
    blocked = threading.Event()

    @stopping.bounded_stops
    async def command(kind):
        if kind == "thread":  # its clean-up waits on a thread that never ends
            asyncio.get_running_loop().run_in_executor(None, blocked.wait)
        print("running", flush=True)
        lost = False
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost = True  # the first cancellation is lost (swallowed): the command goes on

    try:
        asyncio.run(command(sys.argv[1]))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    """
)


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("swallowed", "interrupting again"),  # the second interrupt ends it
        ("thread", "did not stop within 2 s of the signal; exiting (130)"),  # then the process exits
    ],
)
def test_a_stop_that_does_not_finish_is_forced(kind: str, said: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, as in a terminal
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "running\n"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.communicate()  # reaped, its pipes closed (an open one warns in a later test)
    assert proc.returncode == 130 and said in err, err
    assert time.monotonic() - t0 < 15
    if kind == "thread":  # every thread's stack, to debug; and how to go on
        assert "Thread 0x" in err and "continue with: turnrl train x.yaml --resume" in err
    else:
        assert "interrupted" in err and "did not stop" not in err
    # what held the stop: the task that lost its cancel, where it waits
    assert "1 task waiting at <string>:" in err and "in command" in err, err


def test_without_enforce_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library user's process is theirs: no watch, the handler asyncio installs is left alone."""
    import asyncio

    from turnrl.support import stopping

    monkeypatch.setattr(stopping, "_enforced", False)  # an earlier test may have run cli.main here

    @stopping.bounded_stops
    async def command() -> object:
        return signal.getsignal(signal.SIGINT)

    assert not stopping._enforced
    handler = asyncio.run(command())
    assert not isinstance(handler, stopping._Bounded)


BLOCKED = textwrap.dedent(
    """
    import asyncio, signal, sys, threading, time
    from turnrl.cli import _on_sigterm
    from turnrl.support import stopping

    stopping.GRACE_S = 1.0
    signal.signal(signal.SIGTERM, _on_sigterm)
    stopping.enforce()
    other = threading.Thread(target=threading.Event().wait, daemon=True)  # a thread the kernel may pick
    other.start()

    @stopping.bounded_stops
    async def command():
        print(other.native_id, flush=True)
        time.sleep(3600)  # an env step that blocks the event loop's thread

    try:
        asyncio.run(command())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    """
)


def test_a_sigterm_another_thread_got_stops_a_run_whose_loop_is_blocked() -> None:
    """SIGTERM delivered to a thread other than the main one, whose thread blocks in ``time.sleep``
    inside a coroutine: it is relayed to the main thread, and the stop is bounded (exit 130)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        other = int(proc.stdout.readline())
        t0 = time.monotonic()
        _tgkill(proc.pid, other, signal.SIGTERM)  # the kernel may give a process's signal to any thread
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 130, err
    assert time.monotonic() - t0 < 15


def _tgkill(tgid: int, tid: int, signum: int) -> None:
    """Send ``signum`` to thread ``tid`` of process ``tgid`` (the tgkill system call)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    SYS_TGKILL = 234  # x86_64
    assert libc.syscall(SYS_TGKILL, tgid, tid, signum) == 0, ctypes.get_errno()
