"""Demonstrations for the warm start: each task's own solution (``solution/solve.sh``) as the model
turns of an agent, in the format that agent parses. ``warm_start`` replays them through the agent
itself, so the tokens trained on are the agent's own prompts and the model's own replies.

- ``demos:mini``: mini-swe-agent's text-based mode, one command block that runs the solution, then
  the submit command;
- ``demos:codex``: Codex's ``exec_command`` tool, called in the hermes format that ``codex.md``
  teaches, then a closing sentence (a reply with no call ends ``codex exec``)."""

from __future__ import annotations

import json
from typing import Any

from turnrl.tasks import load_task

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def mini(sample: Any) -> list[str] | None:
    """mini's turns that solve the row's task; None when it has no solution."""
    command = _solution(sample)
    if command is None:
        return None
    return [
        _block("THOUGHT: I run the command that does the task.", command),
        _block("THOUGHT: The task is done, so I submit.", SUBMIT),
    ]


def codex(sample: Any) -> list[str] | None:
    """Codex's turns that solve the row's task; None when it has no solution."""
    command = _solution(sample)
    if command is None:
        return None
    call = json.dumps({"name": "exec_command", "arguments": {"cmd": command}})
    return [f"<tool_call>\n{call}\n</tool_call>", "Done."]


def _solution(sample: Any) -> str | None:
    task = load_task(sample.metadata["task"])
    if task.solution is None:
        return None
    lines = task.solution.read_text().splitlines()
    return " && ".join(line for line in lines if line.strip() and not line.startswith(("#", "set -")))


def _block(thought: str, command: str) -> str:
    return f"{thought}\n\n```mswea_bash_command\n{command}\n```"
