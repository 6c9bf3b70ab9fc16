"""What a test's clients leave to the garbage collector: sockets of a server's clients (the agent
SDKs', or those opened in an event loop closed since) that nobody closed. Freed by a collection
during a later test, their ResourceWarning is an unraisable exception that fails that test; freed
where they were left, it says nothing about the code under test."""

from __future__ import annotations

import gc
import warnings


def free_left_sockets() -> None:
    """Collect garbage now, the ResourceWarnings of the sockets it frees ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
