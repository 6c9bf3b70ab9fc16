"""FreeCpus counts what other processes use, not this one's own work (Linux's /proc/stat)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from turnrl.support.cpus import FreeCpus


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.alone
def test_a_busy_process_takes_a_cpu_and_our_own_work_does_not() -> None:
    free = FreeCpus()
    spin(1.0)  # this process's own work
    own = free.measure()
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        free.measure()
        time.sleep(1.0)
        busy = free.measure()
    finally:
        child.kill()
        child.wait()
    assert busy <= free.cpus - 0.6, busy  # the other process's CPU is not free
    assert own >= busy + 0.6, (own, busy)  # our own spin is not counted as another's
