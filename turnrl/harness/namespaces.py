"""The sandbox of a forked run: the namespaces and mounts a run forked by a fork server that itself
runs in a bubblewrap sandbox (``env.preload`` with ``env.sandbox`` on) enters before the agent runs.

The fork server's sandbox is bubblewrap's (``BubblewrapRuntime.server``): the system and turnrl's
environment read-only, the runs' root read-write, a private /tmp, no home, no turnrl output folder,
a network of its own; it keeps the capabilities to make namespaces (in its own user namespace only:
none over the machine). Each run forked from it then, before any thread starts:

1. joins its cgroups (the process cap and CPU share of ``turnrl.harness.cgroup``);
2. enters new mount, PID, IPC and UTS namespaces (and network, unless ``network: host``);
3. sees a private /tmp, home and /dev/shm, its own folder read-write, the files it is given
   read-only, and nothing else of the runs' root (a tmpfs over it hides its sibling runs);
4. forks the run's init (PID 1 of its namespace: when it ends, the kernel kills every process of
   the run), which mounts the namespace's own /proc, brings up its loopback and listens there at
   the gateway's port (the bridge of ``turnrl.harness.keeper``), sets the limits, and drops every
   capability for good (bounding set, ambient set, ``no_new_privs``, ``SECBIT_NOROOT``), so that
   neither the agent nor a program it runs can undo a mount or join another namespace.

What the agent sees is what a run in a bubblewrap sandbox of its own sees (``turnrl.harness.sandbox``).
Standard library only: it runs in the fork server, which imports little.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
from typing import Any

from turnrl.harness.keeper import confine, listen

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 28, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECURE_NOROOT = 0x0F  # SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP and their locks: uid 0 gains no capability
CAPABILITY_VERSION_3 = 0x20080522
RUN_NAMESPACES = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS  # and CLONE_NEWNET, unless host
SIOCSIFFLAGS, IFF_UP = 0x8914, 0x1
HOME = "/tmp/home"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"the run's sandbox: {what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [s.encode() if s is not None else None for s in (source, target, fstype)]
    _check(_libc.mount(*args, flags, data.encode() if data else None), f"mount {target}")


def _tmpfs(target: str, mode: str = "755") -> None:
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode}")


def _bind(fd: int, path: str, read_only: bool = False) -> None:
    """Show the file or folder ``fd`` (opened before what hid it) at ``path``, then close ``fd``."""
    if os.path.isdir(f"/proc/self/fd/{fd}"):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.exists(path):
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o444))
    _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.close(fd)


def enter(spec: dict[str, Any]) -> socket.socket | None:
    """In a run just forked by the fork server (one thread, its own session): enter the run's
    sandbox as ``spec`` says (``folder``, ``read_only``, ``visible``: read-only folders under /tmp to
    show over its private one, ``hidden``, ``cgroups``, ``limits``, ``network``, ``bridge``: the
    gateway's port and socket). Returns in the run's init, PID 1 of
    its namespace, capabilities dropped, with the bridge's listener (None: no bridge), which the
    agent's process must not keep; the process that called it waits for the init and exits as it
    does, never returning."""
    for procs in spec.get("cgroups", []):
        with open(procs, "w") as f:
            f.write("0")
    own_net = spec.get("network", "gateway") == "gateway"
    _check(_libc.unshare(RUN_NAMESPACES | (CLONE_NEWNET if own_net else 0)), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the server's view
    folder = os.open(spec["folder"], os.O_PATH | os.O_DIRECTORY)  # opened before anything hides it
    files = {path: os.open(path, os.O_PATH) for path in spec.get("read_only", [])}
    shown = {path: os.open(path, os.O_PATH) for path in spec.get("visible", []) if os.path.exists(path)}
    _tmpfs("/tmp", "1777")
    for path, fd in shown.items():  # read-only folders under /tmp (a venv, the agent's), shown again
        _bind(fd, path, read_only=True)
    for path in spec.get("hidden", []):
        if os.path.isdir(path):
            _tmpfs(path)
    if os.path.isdir("/dev/shm"):
        _tmpfs("/dev/shm", "1777")
    os.makedirs(HOME, exist_ok=True)
    _bind(folder, spec["folder"])
    for path, fd in files.items():
        _bind(fd, path, read_only=True)
    init = os.fork()  # the first process of the new PID namespace
    if init != 0:
        _wait_for_init(init)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if own_net:
        _loopback_up()
    bridge = spec.get("bridge")
    listener = listen(int(bridge[0])) if bridge else None  # before the agent starts: no race
    confine([], {name: int(value) for name, value in spec.get("limits", {}).items()})
    drop_capabilities()
    return listener


def can_enter() -> str | None:
    """Why a run forked here could not make its namespaces (one line), or None: a child tries."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        reason = b""
        try:
            _check(_libc.unshare(RUN_NAMESPACES | CLONE_NEWNET), "unshare")
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            _tmpfs("/tmp", "1777")
        except OSError as exc:
            reason = str(exc.strerror or exc).encode()
        os.write(write, reason)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        why = f.read().decode()
    os.waitpid(child, 0)
    return (
        f"env.preload with env.sandbox: this machine does not let a forked run make its sandbox ({why})"
        if why
        else None
    )


def _wait_for_init(init: int) -> None:
    """The run's side outside its namespace: wait for its init and exit as it did; a SIGTERM (the
    run's timeout) kills the init, and with it every process of the run, at once."""
    signal.signal(signal.SIGTERM, lambda *_: os.kill(init, signal.SIGKILL))
    while True:
        try:
            _, status = os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _loopback_up() -> None:
    """Bring up ``lo`` of the new network namespace (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", IFF_UP))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


def drop_capabilities() -> None:
    """Give up every capability, for this process and whatever it runs: no program it starts, not
    even one run as uid 0 or a setuid one, gets any back."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.prctl(PR_SET_SECUREBITS, SECURE_NOROOT, 0, 0, 0), "securebits")
    last = 63
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        pass
    for cap in range(last + 1):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # a capability this kernel lacks: nothing to drop
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")
