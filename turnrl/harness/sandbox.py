"""The default runtime of harness runs: each run, and everything it starts, in a bubblewrap sandbox.

What a run sees: the system folders and a few files of /etc read-only, turnrl's Python environment
and the folders its command and hooks come from read-only (``env.sandbox.read_only`` adds more), its
own folder read-write (the only host place it may write), a private /tmp and home, a /proc of its
own PID namespace (no other process of the machine: not a sibling run, not turnrl), no turnrl output
folder and no sibling run folder. Its processes die with it: the sandbox's first process is the run's
keeper, and when it ends the kernel kills everything in the namespace.

The network (``env.sandbox.network``): "gateway" gives the run a network namespace of its own whose
loopback has one listener, the keeper's bridge at the gateway's port, carried to the gateway's Unix
socket bound into the sandbox: the agent reaches its gateway and nothing else (no other port, no
other machine). "host" shares the machine's network.

Limits, from the config, set by the run's keeper inside the sandbox before the agent starts, and
inherited by every process: memory per process (RLIMIT_DATA), file size (RLIMIT_FSIZE), no core
files, and processes: a pids cgroup per run where this machine lets turnrl make one (it holds for
root too), else RLIMIT_NPROC (which the kernel does not apply to root: a warning says so). CPU: a cpu
cgroup per run where the machine has one, at the default share: a run's processes together weigh as
one process, so a fork bomb slows its own run, not its siblings (``turnrl.harness.cgroup``). Each
cgroup's ``cgroup.procs`` is bound into the sandbox for the keeper to join. Wall time is
``env.timeout_s``. Nothing runs between fork and exec in turnrl's process, so a spawn stays a vfork:
a fork of a trainer holding a model would copy its page tables (~0.4 s for 1.5 GB, measured).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from turnrl.config import SandboxConfig
from turnrl.harness.cgroup import RunCgroup, cgroup_roots
from turnrl.harness.runtime import Launch, View, keeper_argv, shown_paths
from turnrl.tools.sandbox import SYSTEM_DIRS, SYSTEM_FILES

log = logging.getLogger(__name__)
ETC: tuple[str, ...] = ("/etc/passwd", "/etc/group", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl")
ETC += (
    "/etc/ca-certificates",
    "/etc/alternatives",
    "/etc/gitconfig",
    "/etc/os-release",
    "/etc/debian_version",
)
HOME = "/tmp/home"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
GATEWAY_SOCKET = "/run/turnrl/gateway.sock"
CGROUP_PROCS = "/run/turnrl/cgroup-{}.procs"
CGROUPS = "/run/turnrl/cgroups"  # where a fork server's sandbox sees the folders of the runs' cgroups
PASSED = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM")  # of turnrl's variables, all a run gets
INSTALL = "apt-get install bubblewrap"
NO_CAP = (
    "env.sandbox: no pids cgroup here, and root is not held by RLIMIT_NPROC: runs' processes are not capped"
)


def bwrap_missing() -> str | None:
    """Why harness runs cannot be sandboxed here (one line), or None."""
    if sys.platform != "linux":
        return f"env.sandbox: bubblewrap sandboxes need Linux, not {sys.platform}; set env.sandbox: none"
    if shutil.which("bwrap") is None:
        return f"env.sandbox: bubblewrap is not installed ({INSTALL}), or set env.sandbox: none"
    return None


# folders never shown to a run whole: each covers its private /tmp, where its home is, and /tmp
# holds other runs' folders (a config kept in /tmp would make its folder, /tmp, a visible one)
COVERS_TMP = frozenset({"/", "/tmp"})
NOT_WHOLE = "keep the config and the modules it names in a folder of their own"


class BubblewrapRuntime:
    """Runs a harness run's commands in bubblewrap (see the module doc)."""

    name = "bubblewrap"

    def __init__(
        self,
        config: SandboxConfig,
        visible: Sequence[str | Path] = (),
        hidden: Sequence[str | Path] = (),
        gateway: tuple[int, Path] | None = None,
    ) -> None:
        missing = bwrap_missing()
        if missing:
            raise RuntimeError(missing)
        self.bwrap = shutil.which("bwrap") or "bwrap"
        self.config = config
        real = shown_paths(visible, config.read_only)
        for whole in sorted(real & COVERS_TMP):  # a config kept in /tmp, say
            log.warning(
                f"the sandbox does not show {whole} whole (other runs' folders are there): {NOT_WHOLE}"
            )
        self.visible = sorted(real - COVERS_TMP, key=len)
        self.hidden = [str(Path(p).resolve()) for p in hidden]
        self.gateway = gateway  # the port agents call, and the gateway's Unix socket
        self.root = os.geteuid() == 0
        self._warned = False

    def launch(
        self,
        argv: Sequence[str],
        folder: Path,
        env: dict[str, str],
        read_only: Sequence[Path] = (),
        gateway: bool = True,
        view: View | None = None,
    ) -> Launch:
        """``argv`` in ``folder`` inside a new sandbox (``gateway``: bridged to the run's gateway;
        ``view``: ``folder`` at its working directory, and its binds); ``Launch.forked`` says what
        the same sandbox is for a run the fork server forks (none with a view: such a run starts
        as a new process)."""
        if view is not None and view.needs:
            raise RuntimeError(f"{view.needs}: set env.sandbox.runtime: podman")
        bridge = self.gateway if gateway and self.config.network == "gateway" else None
        cgroup = RunCgroup.make(self.config.max_processes)
        capped = cgroup is not None and cgroup.limited
        if not capped and self.root and not self._warned:
            self._warned = True
            log.warning(NO_CAP)
        limits = self._limits(not capped)
        options = [arg for name, value in limits.items() for arg in ("--limit", f"{name}={value}")]
        for i in range(len(cgroup.procs) if cgroup is not None else 0):
            options += ["--cgroup", CGROUP_PROCS.format(i)]
        if bridge is not None:
            options += ["--bridge", str(bridge[0]), GATEWAY_SOCKET]
        mounts = self._mounts(folder, read_only, bridge, cgroup, view)
        close = cgroup.close if cgroup is not None else (lambda: None)
        argv_in = [*mounts, "--", *keeper_argv(argv, options)]
        variables = self.variables({**dict(view.env if view else ()), **env})
        launch = Launch(list(argv), argv_in, variables, folder, close=close, sandboxed=True)
        if view is not None:
            return launch
        roots = cgroup_roots()
        launch.forked = {
            "folder": str(folder),
            "read_only": [str(file) for file in read_only],
            "visible": [path for path in self.visible if path.startswith("/tmp/")],
            "hidden": [*self.hidden, CGROUPS],
            "cgroups": [
                f"{CGROUPS}/{roots.index(Path(procs).parent.parent)}/{Path(procs).parent.name}/cgroup.procs"
                for procs in (cgroup.procs if cgroup is not None else [])
            ],
            "limits": limits,
            "network": self.config.network,
            "bridge": [bridge[0], GATEWAY_SOCKET] if bridge is not None else None,
        }
        return launch

    def populate(self, folder: Path, view: View) -> None:
        """Nothing: the sandbox shows this machine's system, not an image (the task's copies are
        made by its place)."""

    def variables(self, env: dict[str, str]) -> dict[str, str]:
        """A run's variables: the few of turnrl's it gets (PASSED), its home and /tmp, ``env``."""
        passed = {key: os.environ[key] for key in PASSED if key in os.environ}
        # this environment's programs first: `python` in what the agent runs is turnrl's interpreter
        # (a python of the user's home, a pyenv shim say, is not in the sandbox)
        passed["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), passed.get("PATH", DEFAULT_PATH)])
        return {**passed, "HOME": HOME, "TMPDIR": "/tmp", **env}

    def server(self, runs: Path) -> list[str]:
        """The argv that starts a fork server in a sandbox (its command follows): what a run sees,
        with ``runs`` (the runs' root) read-write, the gateway's socket and the cgroups of runs
        bound in, and the capabilities to make each run's namespaces (``turnrl.harness.namespaces``),
        in a user namespace of its own."""
        cmd = [self.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
        cmd += ["--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN"]
        cmd += ["--cap-add", "CAP_SETPCAP"]
        cmd += self._view()
        cmd += ["--bind", str(runs), str(runs)]
        if self.gateway is not None and self.config.network == "gateway":
            cmd += ["--ro-bind", str(self.gateway[1]), GATEWAY_SOCKET]
        for i, root in enumerate(cgroup_roots()):
            cmd += ["--bind", str(root), f"{CGROUPS}/{i}"]
        return [*cmd, "--remount-ro", "/", "--"]

    def _limits(self, count_processes: bool) -> dict[str, int]:
        """The ``RLIMIT_*`` a run's processes get: memory, file size, no core files, and the process
        count (RLIMIT_NPROC counts all of the user's tasks: the ones running now, plus the run's)
        when no cgroup caps it."""
        mib = 1 << 20
        limits = {"DATA": self.config.memory_mb * mib, "FSIZE": self.config.file_size_mb * mib, "CORE": 0}
        if count_processes:
            limits["NPROC"] = _tasks_of(os.getuid()) + self.config.max_processes + 4  # + bwrap's own
        return limits

    def _mounts(
        self,
        folder: Path,
        read_only: Sequence[Path],
        bridge: tuple[int, Path] | None,
        cgroup: RunCgroup | None,
        view: View | None = None,
    ) -> list[str]:
        """bwrap's arguments: namespaces, then what the run sees (see the module doc)."""
        cmd = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        cmd += self._view()
        workdir = view.workdir if view is not None else str(folder)
        cmd += ["--bind", str(folder), workdir]
        for bind in view.binds if view is not None else ():
            cmd += ["--bind" if bind.writable else "--ro-bind", str(bind.host), bind.inside]
        for file in read_only:
            cmd += ["--ro-bind", str(file), str(file)]
        if bridge is not None:
            cmd += ["--ro-bind", str(bridge[1]), GATEWAY_SOCKET]
        for i, procs in enumerate(cgroup.procs if cgroup is not None else ()):
            cmd += ["--bind", procs, CGROUP_PROCS.format(i)]  # the keeper joins before the agent starts
        return [*cmd, "--remount-ro", "/", "--chdir", workdir]

    def _view(self) -> list[str]:
        """What every sandbox sees: its network, /proc, /dev, a private /tmp and home, the system
        and the visible folders read-only, turnrl's output and the runs' root hidden."""
        cmd = ["--share-net"] if self.config.network == "host" else []
        cmd += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", HOME]  # first: binds go over
        for path in (*SYSTEM_DIRS, *SYSTEM_FILES, *ETC, *self.visible):
            cmd += ["--ro-bind-try", path, path]
        for path in self.hidden:  # turnrl's output and the runs' root, where a visible folder holds them
            if any(path.startswith(v + "/") or path == v for v in self.visible):
                cmd += ["--tmpfs", path]
        return cmd


def _tasks_of(uid: int) -> int:
    """Processes and threads ``uid`` runs now: RLIMIT_NPROC counts them all, not only the run's."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count
