"""Handing the C heap's free memory back to the system after a training step.

glibc's malloc gives each thread that allocates an arena of its own (up to 8 per core), and keeps
what a thread frees in that arena for its next allocation. A training step's activations are
mostly tensors under glibc's mmap threshold (32 MiB), so they come from the arena of the thread
that ran the step, and stay there, free but resident, after it. When the steps ran on the threads
of asyncio's shared pool, each step could land on another thread, each arena kept its own peak,
and the process grew by a step's activations per step (a Codex run on SmolLM2-135M: 3.6 GB before
its first step, 20 GB at its third, killed for memory at its fourth on 24 GB; the heap then held
1.8 GB in use and 15 GB free). Steps now run on one thread of their own, and ``trim_heap`` after
each returns the free pages of every arena (``malloc_trim``), for the engine and the agents to use
during the next rollout. Where the C library is not glibc, nothing happens.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Return the heap's free memory to the system; whether anything was returned."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def learner_thread(
    name: str = "turnrl-learner",
    initializer: Callable[..., Any] | None = None,
    initargs: tuple[Any, ...] = (),
) -> ThreadPoolExecutor:
    """The one thread a run's training steps run on, so that they allocate from one arena."""
    return ThreadPoolExecutor(1, name, initializer, initargs)
