"""The C heap after a training step: its free pages go back to the system (glibc's malloc_trim)."""

from __future__ import annotations

import subprocess
import sys

# Blocks under glibc's mmap threshold come from the heap; freeing all but every 64th leaves the
# pages free but resident (a kept block sits above them), as a training step's activations do.
PROBE = """
import threading
from turnrl.support.heap import trim_heap
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
def step(out):
    blocks = [bytearray(64 * 1024) for _ in range(6400)]  # 400 MiB, as one step's activations
    out["kept"] = blocks[::64]
    del blocks
out = {}
before = rss()
worker = threading.Thread(target=step, args=(out,))
worker.start(); worker.join()
freed = rss()
trimmed = trim_heap()
print(before, freed, rss(), trimmed)
"""


def test_trim_heap_returns_a_steps_freed_memory_to_the_system() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    before, freed, after, trimmed = out.stdout.split()
    assert int(freed) - int(before) > 300  # freed, but the heap still holds it
    assert trimmed == "True" and int(freed) - int(after) > 300  # handed back
