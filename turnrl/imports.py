"""Resolve ``module:attribute`` strings into objects, with one-line errors."""

from __future__ import annotations

import importlib
from typing import Any


class ImportSpecError(ValueError):
    """A ``module:attribute`` string that does not resolve."""


def import_object(spec: str, what: str = "object") -> Any:
    """Import ``module:attribute`` (or ``module.attribute``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ImportSpecError(f"{what} {spec!r} is not of the form module:name")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ImportSpecError(f"{what} {spec!r} could not be imported: {type(exc).__name__}: {exc}") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ImportSpecError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}") from None
    return obj
