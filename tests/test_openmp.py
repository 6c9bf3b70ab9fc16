"""One OpenMP pool at a time: a thread that hands the cores on frees its pool of worker threads."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from turnrl.engines import HFEngine
from turnrl.models import load_model
from turnrl.support.openmp import release_pool
from turnrl.testing import until
from turnrl.types import SamplingParams

needs_two = torch.get_num_threads() >= 2  # CI's machines have two cores: one OpenMP worker per pool


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(count: int) -> int:
    """The thread count once it reaches ``count`` (a freed worker ends a moment after the release),
    or as it stands after 10 s."""
    deadline = time.monotonic() + 10
    while _threads() != count and time.monotonic() < deadline:
        time.sleep(0.002)
    return _threads()


def _compute() -> None:
    a = torch.randn(512, 512)
    for _ in range(3):
        a = torch.tanh(a @ a)


def test_release_pool_frees_the_calling_threads_workers() -> None:
    """Parallel work leaves a pool of workers behind its thread; release_pool ends them, and the
    next parallel work makes a new pool."""
    assert needs_two, "this machine runs torch on one thread: no pool to see"
    seen: dict[str, int] = {}

    def work() -> None:
        seen["start"] = _threads()
        _compute()
        seen["computed"] = _threads()
        seen["released"] = int(release_pool())
        seen["after"] = _settled(seen["start"])
        _compute()
        seen["again"] = _threads()
        release_pool()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["computed"] > seen["start"] and seen["released"] == 1
    assert seen["after"] == seen["start"] and seen["again"] == seen["computed"], seen


async def test_the_engine_and_its_callers_leave_no_idle_pool(tiny_qwen3_dir: Path) -> None:
    """While the engine generates, its caller's pool is gone; once idle, the engine's worker frees its
    own: an idle engine costs the process one thread, so the next thread to compute is not throttled."""
    model = load_model(str(tiny_qwen3_dir))
    async with HFEngine(model) as engine:
        await asyncio.to_thread(lambda: None)  # the default executor's thread, made before counting
        _compute()  # this thread's pool, as after loading or training a model
        before = _threads()
        await engine.generate([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=8))
        # the engine's worker thread joined; this thread's worker and the engine's pool are gone
        await until(lambda: _threads() == before, 10, "the idle engine freeing its pool and its caller's")
        _compute()
        assert _threads() == before + 1


SPARE = """
import os, time
from turnrl.support.openmp import SpareWorkers, release_pool
import torch

def threads():
    return len(os.listdir("/proc/self/task"))

def settled(count):
    deadline = time.monotonic() + 10
    while threads() != count and time.monotonic() < deadline:
        time.sleep(0.002)
    return threads()

spare = SpareWorkers()
with spare:  # its thread, and what torch's first parallel work starts once, made before counting
    pass
before = settled(threads() - 1)
with spare:
    held = threads()
    a = torch.randn(256, 256)
    (a @ a).sum()  # other work goes on meanwhile
    release_pool()  # this thread's own pool
after = settled(before)
with spare:  # held again: a new pool
    again = threads()
spare.close()
print(before, held, after, again)
"""


def test_spare_workers_hold_one_idle_pool_while_held() -> None:
    """``SpareWorkers`` (a learner process computes: serving's workers should spin less): while held,
    the process has a pool more (libgomp then counts more workers than cores and shortens every
    team's spin); released, the pool is gone. In a process of its own: no other test's threads."""
    assert needs_two, "this machine runs torch on one thread: no pool to see"
    done = subprocess.run([sys.executable, "-c", SPARE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    before, held, after, again = (int(n) for n in done.stdout.split())
    assert held == before + 1 and after == before and again == held, (before, held, after, again)
