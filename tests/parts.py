"""The parts of the machine a test needs beyond ``.venv`` (vLLM's virtualenv, llama.cpp's
``llama-server``, Chromium, bubblewrap...), which ``scripts/test.sh`` installs: without one a test
skips, unless ``CI`` is set: there a missing part is a failure."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def missing(message: str) -> NoReturn:
    """Skip for want of a part; in CI (CI set) that is a failure instead."""
    if in_ci():
        pytest.fail(f"{message} (CI is set, so this is a failure)")
    pytest.skip(message)


def await_part(name: str, timeout_s: float = 2400.0) -> None:
    """Wait for ``scripts/test.sh``'s install NAME to end where it runs beside the tests (llama.cpp's
    compile does), so its part is there; fail with its log's end if it failed or took too long."""
    folder = os.environ.get("TURNRL_TEST_PARTS")
    if not folder:  # not under scripts/test.sh: what the machine has is what there is
        return
    done = Path(folder) / f"{name}.done"
    end = time.monotonic() + timeout_s
    while not done.is_file():
        if time.monotonic() > end:
            pytest.fail(f"scripts/test.sh's {name} did not end within {timeout_s:.0f} s")
        time.sleep(2.0)
    status = done.read_text().split()[0]
    if status != "0":
        log = (Path(folder) / f"{name}.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"scripts/test.sh's {name} failed (exit {status}):\n{log}")
