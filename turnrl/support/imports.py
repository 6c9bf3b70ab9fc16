"""Resolve ``module:attribute`` strings into objects, with one-line errors."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from turnrl.support.errors import describe


class ImportSpecError(ValueError):
    """A ``module:attribute`` string that does not resolve."""


_SEARCHED: list[str] = []  # folders added for user modules (a config's folder, the working directory)


def add_search_path(*folders: str | os.PathLike[str]) -> None:
    """Make modules in ``folders`` importable by ``module:name`` specs (appended to ``sys.path``:
    installed packages keep precedence)."""
    for folder in folders:
        path = str(Path(folder).resolve())
        if path not in sys.path:
            sys.path.append(path)
        if path not in _SEARCHED:
            _SEARCHED.append(path)


def search_path() -> list[str]:
    """The folders ``add_search_path`` added, in order."""
    return list(_SEARCHED)


def _where() -> str:
    """Where a module was looked for, for an error line."""
    folders = ", ".join(_SEARCHED) or str(Path.cwd())
    return f"searched {folders} and the installed packages"


def import_object(spec: str, what: str = "object") -> Any:
    """Import ``module:attribute`` (or ``module.attribute``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ImportSpecError(f"{what} {spec!r} is not of the form module:name")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name != missing and not module_name.startswith(missing + "."):  # one of its imports
            raise ImportSpecError(f"{what} {spec!r} could not be imported: {exc}") from None
        raise ImportSpecError(f"{what} {spec!r}: no module named {exc.name!r} ({_where()})") from None
    except Exception as exc:
        raise ImportSpecError(f"{what} {spec!r} could not be imported: {describe(exc)}") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ImportSpecError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}") from None
    return obj
