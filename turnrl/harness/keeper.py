"""The keeper of one harness run: the process that starts the agent, waits for it, and then kills
everything the agent left behind, however it got away (``setsid``, a double fork).

It makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process of the run whose parent
dies is handed to the keeper, not to the machine's init, so when the agent ends the keeper finds
every survivor among its own children and kills it. A SIGTERM (the run's timeout) does the same at
once. Inside a sandbox it also bridges the gateway: it listens on ``127.0.0.1:PORT`` of the sandbox's
own network, where the agent's client connects, and carries each connection to the gateway's Unix
socket bound into the sandbox; nothing else is reachable.

``python -I -S keeper.py [--bridge PORT SOCKET] [--cgroup PROCS]... [--limit NAME=N]... -- ARGV...``
(``--cgroup``: a ``cgroup.procs`` of the run to join; ``--limit DATA=BYTES``: an ``RLIMIT_*`` to set,
both before the agent starts): standard library only (it runs with no
site-packages, in a fraction of the time an import of turnrl takes). Its exit status is the agent's
(a signal N as 128 + N, as a shell reports it). ``keep_forked`` is the same keeper for a run forked
by the fork server, which cannot exec.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

PR_SET_CHILD_SUBREAPER = 36
PASSES = 64  # rounds of "kill every child, reap": each round takes the orphans of the last one
KILL_WAIT_S = 2.0  # how long a round waits for the children it killed to be reaped


def become_subreaper() -> None:
    """Orphans of this process's descendants become its children (Linux; elsewhere: no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def children() -> list[int]:
    """This process's children, from ``/proc`` (every thread's list)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
                found += [int(pid) for pid in f.read().split()]
    return found


def kill_all() -> None:
    """SIGKILL every descendant: children first, each waited for until it is reaped (its orphans
    come to this process, a subreaper, before it can be reaped, and are killed in the next pass).
    Not waiting would let a slow death (a large process tearing down its memory on a loaded
    machine) outlast every pass, and its orphans outlive the keeper."""
    for _ in range(PASSES):
        alive = children()
        if not alive:
            break
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _reap_killed(set(alive))
    list(reaped())


def _reap_killed(pids: set[int], limit_s: float = KILL_WAIT_S) -> None:
    """Reap ``pids`` (killed) and whatever else ended, for at most ``limit_s`` seconds (a process
    stuck in the kernel may not die at once: the next pass, or the process group kill, takes it)."""
    deadline = time.monotonic() + limit_s
    while pids and time.monotonic() < deadline:
        pids -= {pid for pid, _ in reaped()}
        pids &= set(children())  # reaped by someone else, or gone: not waited for
        if pids:
            time.sleep(0.001)


def reaped() -> Iterator[tuple[int, int]]:
    """Each child that has exited, reaped: its pid and exit code (``-N``: killed by signal N)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def wait_for(pid: int) -> int:
    """``pid``'s exit code (``-N``: killed by signal N), reaping the orphans that end before it."""
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        if got == pid:
            return os.waitstatus_to_exitcode(status)


def signal_process(pid: int, sig: int, group: bool = False) -> None:
    """``sig`` to the process ``pid`` of this PID namespace (``group``: its whole process group);
    gone already, or not ours: nothing to do."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, sig)


def end(code: int) -> None:
    """Kill what is left, then exit with ``code`` (a signal by the signal itself, or as 128 + N by
    the init of a PID namespace, which its own signals cannot end)."""
    kill_all()
    if code < 0 and os.getpid() != 1:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(128 - code if code < 0 else code & 0xFF)


def _on_term(*_: object) -> None:
    kill_all()
    os._exit(128 + signal.SIGTERM)


def keep_forked(run: Callable[[], int], bridge: tuple[socket.socket, str] | None = None) -> None:
    """In a run forked by the fork server (the run's session leader, or the init of its sandbox):
    fork once more, ``run`` in the grandchild, and keep it from here, carrying ``bridge`` (a
    listener and the gateway's socket) meanwhile; never returns."""
    become_subreaper()
    signal.signal(signal.SIGTERM, _on_term)  # before the fork: a stop that comes early still kills the run
    pid = os.fork()
    if pid == 0:
        if bridge is not None:
            bridge[0].close()
        os.setsid()  # the agent leads its own session, as a new process would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os._exit(run())
    if bridge is not None:
        threading.Thread(target=_bridge, args=bridge, daemon=True).start()
    end(wait_for(pid))


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until ``source`` ends, then end ``sink``'s writing side."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _carry(client: socket.socket, path: str) -> None:
    with client, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gateway:
        try:
            gateway.connect(path)
        except OSError:
            return
        back = threading.Thread(target=_pump, args=(gateway, client), daemon=True)
        back.start()
        _pump(client, gateway)
        back.join()


def _bridge(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_carry, args=(client, path), daemon=True).start()


def listen(port: int) -> socket.socket:
    """A listener on the sandbox's loopback at ``port``."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    return listener


def confine(cgroups: list[str], limits: dict[str, int]) -> None:
    """Move this process into the run's cgroups (their ``cgroup.procs``) and set its resource limits:
    what it starts inherits both. Done here, inside the sandbox, rather than between fork and exec
    in turnrl, which would make every spawn copy the trainer's page tables (a fork, not a vfork)."""
    for procs in cgroups:
        with open(procs, "w") as f:
            f.write("0")
    for name, value in limits.items():
        which = getattr(resource, f"RLIMIT_{name}")
        resource.setrlimit(which, (value, value))


def main(args: list[str]) -> None:
    """Confine and bridge (as asked), start ``ARGV`` and keep it."""
    bridge: tuple[int, str] | None = None
    cgroups: list[str] = []
    limits: dict[str, int] = {}
    while args and args[0] != "--":
        if args[0] == "--bridge":
            bridge, args = (int(args[1]), args[2]), args[3:]
        elif args[0] == "--cgroup":
            cgroups.append(args[1])
            args = args[2:]
        elif args[0] == "--limit":
            name, _, value = args[1].partition("=")
            limits[name] = int(value)
            args = args[2:]
        else:
            raise SystemExit(f"keeper: unknown option {args[0]!r}")
    argv = args[1:]
    confine(cgroups, limits)
    become_subreaper()
    listener = listen(bridge[0]) if bridge else None  # before the agent starts: no race
    signal.signal(signal.SIGTERM, _on_term)  # before the fork (exec resets it in the agent)
    pid = os.fork()
    if pid == 0:
        if listener is not None:
            listener.close()
        os.setsid()  # the agent leads its own session, as a new process would
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            os.write(2, f"cannot start {argv[0]!r}: {exc.strerror or exc}\n".encode())
            os._exit(127)
    if listener is not None and bridge is not None:
        threading.Thread(target=_bridge, args=(listener, bridge[1]), daemon=True).start()
    end(wait_for(pid))


if __name__ == "__main__":
    main(sys.argv[1:])
