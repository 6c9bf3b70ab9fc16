"""Config files that tools and envs read (tools YAML, interaction YAML, MCP servers JSON)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


def read_data_file(
    source: str | os.PathLike[str] | Mapping[str, Any], what: str, error: type[Exception]
) -> Any:
    """The data of a YAML or JSON file (JSON is YAML), or ``source`` itself when it is already
    loaded; ``error`` with one line naming ``what`` and the path when it is missing or unparsable."""
    if isinstance(source, Mapping):
        return source
    file = Path(source)
    if not file.is_file():
        raise error(f"{what} not found: {file}")
    try:
        return yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())
        raise error(f"{what} {file} is not valid YAML or JSON: {reason}") from None


def file_version(path: str | os.PathLike[str]) -> tuple[str, int]:
    """A file's resolved path and modification time: the key of a per-file-version cache."""
    resolved = Path(path).expanduser().resolve()
    return str(resolved), resolved.stat().st_mtime_ns if resolved.is_file() else 0
