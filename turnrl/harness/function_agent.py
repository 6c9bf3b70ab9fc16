"""``python -m turnrl.harness.function_agent module:function``: run a harness agent given as a
Python callable, in a process of its own: ``fn(sample, folder)`` with the row (TURNRL_SAMPLE) and
the working folder (sync or async). An exception is printed and exits 1."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
from pathlib import Path

from turnrl.support.imports import import_object


def main() -> None:
    """Call the agent named on the command line."""
    fn = import_object(sys.argv[1], "env.command")
    sample = json.loads(Path(os.environ["TURNRL_SAMPLE"]).read_text(encoding="utf-8"))
    out = fn(sample, Path.cwd())
    if inspect.isawaitable(out):
        asyncio.run(_wait(out))


async def _wait(out: object) -> None:
    await out  # type: ignore[misc]


if __name__ == "__main__":
    main()
