"""The parts of the machine a test needs beyond ``.venv`` (vLLM's virtualenv, llama.cpp's
``llama-server``, Chromium, bubblewrap...), which ``scripts/test.sh`` installs: without one a test
skips, unless ``CI`` is set: there a missing part is a failure."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def missing(message: str) -> NoReturn:
    """Skip for want of a part; in CI (CI set) that is a failure instead."""
    if in_ci():
        pytest.fail(f"{message} (CI is set, so this is a failure)")
    pytest.skip(message)
