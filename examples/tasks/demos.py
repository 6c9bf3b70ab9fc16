"""Demonstrations for a warm start on task rows (``warm_start.demos: "demos:solution"``): each task's
own solution (``solution/solve.sh``) as mini-swe-agent's model turns, in the model's tool-call
format (Qwen3's): one bash call that runs the solution's commands, then the submit command.
``warm_start`` replays them through ``mini`` itself, so the tokens are the agent's own."""

from __future__ import annotations

import json
from typing import Any

from turnrl.tasks import load_task


def solution(sample: Any) -> list[str] | None:
    """The model turns that solve the row's task; None when it has no solution."""
    task = load_task(sample.metadata["task"])
    if task.solution is None:
        return None
    lines = task.solution.read_text().splitlines()
    commands = [line for line in lines if line.strip() and not line.startswith(("#", "set -"))]
    return [_bash(" && ".join(commands)), _bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]


def _bash(command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<tool_call>\n{call}\n</tool_call>"
