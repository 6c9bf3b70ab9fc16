"""Where in the user's own code an exception was raised: the file and line a one-line error names."""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

PACKAGE = str(Path(__file__).resolve().parents[1])  # turnrl's own files
LIBRARIES = tuple(
    str(Path(path).resolve())
    for path in {sysconfig.get_path(kind) for kind in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def raised_at(exc: BaseException) -> str | None:
    """``FILE:LINE`` of the innermost frame of ``exc`` in the user's own code (not turnrl, not the
    standard library, not an installed package); else the innermost outside turnrl; None if none."""
    frames = traceback.extract_tb(exc.__traceback__)
    outside = [f for f in frames if not str(Path(f.filename).resolve()).startswith(PACKAGE)]
    own = [f for f in outside if not str(Path(f.filename).resolve()).startswith(LIBRARIES)]
    chosen = own or outside
    return f"{chosen[-1].filename}:{chosen[-1].lineno}" if chosen else None
