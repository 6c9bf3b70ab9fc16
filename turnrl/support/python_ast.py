"""``ast.parse`` one thread at a time. CPython keeps the AST constructor's recursion count in the
interpreter's state, shared by every thread: a parse that runs Python code midway (a collection
calling ``__del__``) can switch threads, and a parse in the other thread then throws the count off,
so one of them fails with ``SystemError: AST constructor recursion depth mismatch`` (CPython
gh-106905). A calculator tool in its worker thread and a tool-call parser on the event loop parse
at the same time; each parse here holds one lock (reentrant: a ``__del__`` may parse too)."""

from __future__ import annotations

import ast
import threading
from typing import Any

_LOCK = threading.RLock()


def parse_expression(source: str) -> ast.expr:
    """The expression ``source`` holds (``ast.parse(source, mode="eval").body``), parsed under the lock."""
    with _LOCK:
        return ast.parse(source, mode="eval").body


def literal_eval(text: str) -> Any:
    """``ast.literal_eval(text)``, its parse under the lock."""
    return ast.literal_eval(parse_expression(text.lstrip(" \t")))
