"""A blocking ``flock`` on a file, held for a ``with`` block (the OS drops it if the process dies)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold ``path``'s lock (the file made if missing): exclusive, or ``shared`` with other shared
    holders; waits until it can."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock
