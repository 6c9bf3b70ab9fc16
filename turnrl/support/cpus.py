"""How many CPUs the other processes of the machine leave free: a busy laptop or CI machine makes
two compute threads wait on each other, so long CPU work sizes its threads to what is free."""

from __future__ import annotations

import os
import time


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _machine_times() -> tuple[float, float] | None:
    """All CPUs' busy and total jiffies since boot (Linux's /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as stat:
            fields = [float(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class FreeCpus:
    """The CPUs left free by other processes between ``FreeCpus()`` (or the last ``measure``) and
    now: the machine's busy time less this process's own."""

    def __init__(self) -> None:
        self.cpus = os.cpu_count() or 1
        self._last = self._now()

    def _now(self) -> tuple[tuple[float, float] | None, float]:
        return _machine_times(), time.process_time()

    def measure(self) -> float:
        """Free CPUs since the last call (every CPU when the machine's times cannot be read)."""
        (machine, own), (before, own_before) = self._now(), self._last
        self._last = (machine, own)
        if machine is None or before is None or machine[1] <= before[1]:
            return float(self.cpus)
        busy_share = (machine[0] - before[0]) / (machine[1] - before[1])  # of all CPUs' time
        wall = (machine[1] - before[1]) / self.cpus / os.sysconf("SC_CLK_TCK")
        others = busy_share * self.cpus - (own - own_before) / max(wall, 1e-3)
        return min(float(self.cpus), max(0.0, self.cpus - max(0.0, others)))


class ThreadFit:
    """Keeps the calling thread's torch compute threads at the CPUs other processes leave free
    (at least 1, at most torch's count when made), checked at most every ``every_s`` seconds."""

    def __init__(self, every_s: float = 10.0) -> None:
        import torch

        self.free = FreeCpus()
        self.most = torch.get_num_threads()
        self.every_s = every_s
        self.threads = 0  # not set yet
        self._checked = -float("inf")

    def __call__(self) -> float | None:
        """Check when due and set the threads; the free CPUs when the count changed, else None."""
        import torch

        if time.perf_counter() - self._checked < self.every_s:
            return None
        self._checked = time.perf_counter()
        cpus = self.free.measure()
        fit = max(1, min(self.most, round(cpus)))
        if fit == self.threads:
            return None
        torch.set_num_threads(fit)
        self.threads = fit
        return cpus

    def restore(self) -> None:
        """Back to the threads torch had."""
        import torch

        torch.set_num_threads(self.most)
