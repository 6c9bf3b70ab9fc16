"""A toy repository task for a coding agent under ``turnrl train``: make ``test_calc.py`` pass in a
copy of ``examples/tasks/train/calc-repo/repo/`` (the SWE-style task calc-repo). The reward runs the
test in the folder the agent worked in."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def reward(sample: Any, result: Any) -> float:
    """1.0 when ``python test_calc.py`` passes in the agent's folder, else 0.0."""
    done = subprocess.run(
        [sys.executable, "test_calc.py"], cwd=result.folder, capture_output=True, timeout=60, check=False
    )
    return float(done.returncode == 0)


def tasks(size: int = 8) -> list[dict[str, Any]]:
    """``size`` rows of the one task (a group of attempts per row)."""
    prompt = "Implement add in calc.py so that `python test_calc.py` passes."
    return [{"id": f"calc/{i}", "prompt": [{"role": "user", "content": prompt}]} for i in range(size)]


def demonstration(sample: Any) -> list[str]:
    """The model turns of a solved episode, in the model's own tool-call format (Qwen3's): write
    ``calc.py``, then submit. ``warm_start`` replays them through mini-swe-agent itself."""
    fix = "printf 'def add(a, b):\\n    return a + b\\n' > calc.py"
    return [_bash(fix), _bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]


def _bash(command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<tool_call>\n{call}\n</tool_call>"
