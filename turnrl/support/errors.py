"""One way to say what went wrong: an exception as one line."""

from __future__ import annotations


def describe(exc: BaseException) -> str:
    """An exception as one line: its type and message (``ValueError: bad row``)."""
    return f"{type(exc).__name__}: {exc}"
