"""A cgroup per sandboxed run, where this machine lets turnrl make one, in each of two controllers:

- ``pids``: a limit on the run's processes that also holds for root (RLIMIT_NPROC does not), and a
  list of every process of the run to kill at its end;
- ``cpu``: the run's processes together weigh as one process of the user (the default share), so a
  run that forks a hundred busy processes slows itself, not its sibling runs nor the trainer.

cgroup v1 (a hierarchy per controller) or v2 (the controller delegated to turnrl's own cgroup);
where a controller is missing, that part is left out (``RunCgroup.limited`` says whether the process
cap holds) and the caller falls back on RLIMIT_NPROC."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from pathlib import Path

KILL_PASSES = 64
CONTROLLERS = ("pids", "cpu")


@functools.cache
def _roots() -> dict[str, Path]:
    """For each of CONTROLLERS this machine has: the folder of this process's own cgroup in it."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    own = {}
    for line in groups:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    roots: dict[str, Path] = {}
    for line in mounts:
        fields = line.split()
        tail = fields[fields.index("-") + 1 :]
        point, fstype, options = fields[4], tail[0], tail[2].split(",") if len(tail) > 2 else []
        for name in CONTROLLERS:
            if fstype == "cgroup" and name in options and name in own:
                roots[name] = Path(point + own[name])
    for line in mounts:  # v2 for what v1 lacks
        fields = line.split()
        tail = fields[fields.index("-") + 1 :]
        if tail[0] == "cgroup2" and "" in own:
            folder = Path(fields[4] + own[""])
            with contextlib.suppress(OSError):
                delegated = (folder / "cgroup.controllers").read_text().split()
                for name in CONTROLLERS:
                    if name in delegated:
                        roots.setdefault(name, folder)
    return roots


def cgroup_roots() -> list[Path]:
    """The folders the runs' cgroups are made in (one per hierarchy), in a fixed order."""
    return sorted(set(_roots().values()))


class RunCgroup:
    """One run's cgroups: the run's keeper moves in by writing ``0`` to each of ``procs`` (bound
    into its sandbox) before the agent starts."""

    def __init__(self, folders: list[Path], limited: bool) -> None:
        self.folders = folders
        self.limited = limited
        self.procs = [str(folder / "cgroup.procs") for folder in folders]

    @classmethod
    def make(cls, limit: int) -> RunCgroup | None:
        """New cgroups under this process's own, the process count capped at ``limit``; None when
        this machine gives none."""
        name = f"turnrl-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        folders: dict[Path, set[str]] = {}
        for controller, root in _roots().items():
            folders.setdefault(root / name, set()).add(controller)
        made, limited = [], False
        for folder, controllers in folders.items():
            try:
                folder.mkdir()
            except OSError:
                continue
            made.append(folder)
            if "pids" in controllers:
                try:
                    (folder / "pids.max").write_text(str(limit))
                    limited = True
                except OSError:
                    with contextlib.suppress(OSError):
                        folder.rmdir()
                    made.pop()
        return cls(made, limited) if made else None

    def pids(self) -> list[int]:
        """The processes in it now."""
        found: set[int] = set()
        for procs in self.procs:
            try:
                with open(procs) as f:
                    found.update(int(pid) for pid in f.read().split())
            except OSError:
                continue
        return sorted(found)

    def close(self) -> None:
        """Kill every process still in it, then remove it."""
        for _ in range(KILL_PASSES):
            alive = self.pids()
            if not alive:
                break
            for pid in alive:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        for folder in self.folders:
            for _ in range(KILL_PASSES):  # the killed leave as their parents reap them
                try:
                    folder.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)
