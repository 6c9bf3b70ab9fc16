"""Seeds: a distinct, reproducible one per trajectory's env and per model turn, the same on every rerun
(the turn loop and the gateway's sessions draw them alike)."""

from __future__ import annotations

import zlib

from turnrl.types import Sample


def env_seed(base: int | None, sample: Sample, index: int) -> int | None:
    """The env's seed for one trajectory: the row's own, else derived from the run's seed, the
    sample and the index in the group (distinct per trajectory, the same on every rerun)."""
    if sample.seed is not None or base is None:
        return sample.seed
    return zlib.crc32(f"{base}/{sample.id}/{index}/env".encode())


def request_seed(base: int | None, sample: Sample, index: int, turn: int) -> int | None:
    """A distinct, reproducible seed per (sample, index in group, turn), or None when unseeded."""
    if base is None:
        return None
    return zlib.crc32(f"{base}/{sample.id}/{index}/{turn}".encode())
