"""Where turnrl keeps what it builds (tiny models, llama.cpp): one folder for every part."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where built models go: ``$TURNRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/turnrl`` (``~/.cache/turnrl``)."""
    if root := os.environ.get("TURNRL_CACHE_DIR"):
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "turnrl"
