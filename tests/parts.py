"""The parts of the machine a test needs beyond ``.venv``: vLLM's virtualenv, llama.cpp's
``llama-server``, Chromium, bubblewrap... ``scripts/test.sh`` installs the long ones beside the
tests (``$TURNRL_TEST_PARTS``: each part's log, then ``<name>.done`` with its exit status and
seconds), so a test that needs one waits for its install to end; without the part a test skips,
unless ``CI`` is set: there a missing part is a failure."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NoReturn

import pytest

WAIT_S = 1800.0  # llama.cpp's compile takes about 10 minutes on 2 idle cores


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def missing(message: str) -> NoReturn:
    """Skip for want of a part; in CI (CI set) that is a failure instead."""
    if in_ci():
        pytest.fail(f"{message} (CI is set, so this is a failure)")
    pytest.skip(message)


def _folder(install: str) -> Path | None:
    """Where ``scripts/test.sh`` reports on ``install``, if it runs it beside the tests."""
    folder = os.environ.get("TURNRL_TEST_PARTS")
    if not folder or not (Path(folder) / f"{install}.log").is_file():
        return None
    return Path(folder)


def wait_for(install: str) -> None:
    """Return once ``scripts/<install>.sh`` has ended, or after ``WAIT_S``, if ``scripts/test.sh``
    runs it beside the tests (at once otherwise). ``installed`` says how it went."""
    if (folder := _folder(install)) is None:
        return
    deadline = time.monotonic() + WAIT_S
    while not (folder / f"{install}.done").is_file() and time.monotonic() < deadline:
        time.sleep(0.5)


def installed(install: str) -> None:
    """Fail the test with the end of its log if ``scripts/<install>.sh``, run beside the tests, has
    failed or not ended."""
    if (folder := _folder(install)) is None:
        return
    done = folder / f"{install}.done"
    if not done.is_file():
        pytest.fail(f"scripts/{install}.sh has not ended after {WAIT_S:.0f} s")
    status = int(done.read_text().split()[0])
    if status != 0:
        log = (folder / f"{install}.log").read_text(errors="replace")
        pytest.fail(f"scripts/{install}.sh failed (exit {status}): {log[-1500:]}")
