"""A pids cgroup per sandboxed run, where this machine lets turnrl make one: a limit on the run's
processes that also holds for root (RLIMIT_NPROC does not), and a list of every process of the run
to kill at its end. cgroup v1 (a ``pids`` hierarchy) or v2 (the ``pids`` controller delegated to
turnrl's own cgroup); anywhere else ``PidsCgroup.make`` answers None and the caller falls back on
RLIMIT_NPROC."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from pathlib import Path

KILL_PASSES = 64


@functools.cache
def _pids_root() -> Path | None:
    """The folder of this process's own pids cgroup, v1 or v2 (None: no such hierarchy)."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    own = {}
    for line in groups:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    for line in mounts:
        fields = line.split()
        tail = fields[fields.index("-") + 1 :]
        point, fstype, options = fields[4], tail[0], tail[2].split(",") if len(tail) > 2 else []
        if fstype == "cgroup" and "pids" in options and "pids" in own:
            return Path(point + own["pids"])
        if fstype == "cgroup2" and "" in own:
            folder = Path(point + own[""])
            with contextlib.suppress(OSError):
                if "pids" in (folder / "cgroup.controllers").read_text().split():
                    return folder
    return None


class PidsCgroup:
    """One run's pids cgroup: the run's keeper moves in by writing ``0`` to ``procs`` (bound into its
    sandbox) before the agent starts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.procs = str(path / "cgroup.procs")

    @classmethod
    def make(cls, limit: int) -> PidsCgroup | None:
        """A new cgroup of at most ``limit`` processes under this process's own, or None."""
        root = _pids_root()
        if root is None:
            return None
        path = root / f"turnrl-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
        except OSError:
            return None
        try:
            (path / "pids.max").write_text(str(limit))
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return cls(path)

    def pids(self) -> list[int]:
        """The processes in it now."""
        try:
            with open(self.procs) as f:
                return [int(pid) for pid in f.read().split()]
        except OSError:
            return []

    def close(self) -> None:
        """Kill every process still in it, then remove it."""
        for _ in range(KILL_PASSES):
            alive = self.pids()
            if not alive:
                break
            for pid in alive:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        for _ in range(KILL_PASSES):  # the killed leave as their parents reap them
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.01)
