"""One OpenMP worker pool at a time: handing the cores from one torch thread to another.

torch on Linux computes in OpenMP (libgomp), and libgomp gives every thread that starts parallel
work a pool of worker threads of its own, kept after the work ends. Once two threads have done
torch work (the trainer's and the embedded engine's worker, or the caller that loaded a model
and the engine), the process holds more OpenMP threads than the machine has cores, and libgomp
then keeps its workers from spinning between parallel regions: each region wakes them from
sleep instead. A decode step runs hundreds of small regions, so the engine ran about a quarter
slower (68 against 52 ms a step, SmolLM2-135M at batch 32 on two cores) whenever another thread
still held a pool: the one that computed with the model before serving it, or the trainer's.

``release_pool`` frees the calling thread's pool (``omp_pause_resource_all``, OpenMP 5.0); the
thread's next parallel work makes a new one, which costs a thread start. Threads that hand work
to another one call it: the engine's worker when it goes idle, callers of the engine as they hand
it requests, the trainer's update thread after each update. Where torch uses another runtime,
or none, nothing happens.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable

_SOFT = 1  # omp_pause_soft: free the threads, keep nothing else


@functools.cache
def _loaded_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the OpenMP runtime torch computes with, if any: looked up from
    torch's own library, which finds the runtime it is linked to (other packages bring copies of
    libgomp of their own, whose pause would free nothing of torch's)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:  # not Linux: no /proc
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libtorch_cpu"):
            try:
                function = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):  # no OpenMP, or one older than 5.0's pause
                return None
            function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            return function
    return None


def release_pool() -> bool:
    """Free this thread's OpenMP worker threads (call it outside parallel work, when handing the
    cores to another thread); whether a runtime did."""
    pause = _loaded_pause() if "torch" in sys.modules else None  # torch loads the runtime
    return pause is not None and pause(_SOFT) == 0


class SpareWorkers:
    """While held (``with spare:``), this process keeps one idle OpenMP worker more than the cores:
    libgomp then makes every team's workers sleep after a short spin between parallel regions
    (about 1,000 rounds instead of about 300,000), so the cores that their spinning would burn go
    to another process (a learner process at nice 19, whose updates otherwise get no CPU while the
    engine serves without a pause). Released, the engine's workers spin at full length again.

    The idle worker belongs to a thread of its own, which makes its pool with one parallel sum
    and frees it on release. Where torch uses another OpenMP runtime, or none, it does nothing
    harmful: a thread that sums a vector."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._thread = ThreadPoolExecutor(1, "turnrl-spare-openmp")

    def __enter__(self) -> None:
        self._thread.submit(_make_pool).result()

    def __exit__(self, *exc: object) -> None:
        self._thread.submit(release_pool).result()

    def close(self) -> None:
        self._thread.shutdown(wait=False)


def _make_pool() -> None:
    """Run one parallel region on this thread with two threads or more (its pool stays)."""
    import torch

    torch.set_num_threads(max(2, torch.get_num_threads()))
    torch.ones(1 << 20).sum()
