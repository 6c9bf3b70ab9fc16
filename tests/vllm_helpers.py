"""What the tests on real vLLM servers share: the skip-or-fail rule, the model, the tolerance, and
the process-table check for servers that outlived their engine."""

from __future__ import annotations

import os
import subprocess

import pytest

from turnrl.types import EngineError

MODEL = "smollm2-135m"  # what the shared servers serve (SmolLM2-135M-Instruct, saved as float32)
TOLERANCE = 2e-4  # nats, vLLM CPU float32 vs a transformers float32 forward pass (measured: up to 1.03e-4)


def need_vllm() -> None:
    """Skip without vLLM's environment; in CI (CI set) that is a failure instead."""
    from turnrl.engines.vllm_server import find_vllm_python

    try:
        find_vllm_python()
    except EngineError as exc:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{exc} (CI is set, so this is a failure)")
        pytest.skip(str(exc))


def running(pids: list[int]) -> list[int]:
    """Which of ``pids`` (or processes in their groups) are still running."""
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True, check=True)
    alive = []
    for line in out.stdout.splitlines():
        pid, pgid, stat = line.split()[:3]
        if (int(pid) in pids or int(pgid) in pids) and not stat.startswith("Z"):
            alive.append(int(pid))
    return alive
