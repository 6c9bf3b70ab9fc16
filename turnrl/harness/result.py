"""What a harness run left (``HarnessResult``), and its score: the user's reward, checked."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.harness.process import CommandResult
from turnrl.support.user_code import raised_at
from turnrl.types import Message, Sample, Trajectory

HarnessRewardFn = Callable[[Sample, "HarnessResult"], Any]
CommandRunner = Callable[[list[str], float], CommandResult]


@dataclass
class HarnessResult:
    """One agent run, as its reward sees it."""

    branches: list[Trajectory]  # the session's branches, in the order they started
    exit_code: int | None  # None: it did not start, or was killed at the timeout
    timed_out: bool
    stdout: str  # the last characters of what it printed
    stderr: str
    folder: Path  # its working folder (removed after scoring unless env.keep_folders)
    calls: int = 0  # model calls answered
    info: dict[str, Any] = field(default_factory=dict)
    runner: CommandRunner | None = field(default=None, repr=False)  # the run's runtime, for ``run``
    commands: list[dict[str, Any]] = field(default_factory=list)  # what ``run`` ran, kept with the run

    def run(self, command: str | list[str], timeout_s: float = 600.0) -> CommandResult:
        """Run ``command`` (a shell line, or an argv) in the run's folder, in the run's sandbox (as the
        agent ran: the same view, limits and no network), after the agent ended: a task's tests.
        Blocking (the reward runs in a thread of its own); everything it starts ends with it."""
        if self.runner is None:
            raise RuntimeError("this result has no runtime to run commands in")
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        result = self.runner(argv, timeout_s)
        self.commands.append(
            {"command": command, "exit_code": result.exit_code, "seconds": round(result.seconds, 3)}
        )
        return result

    @property
    def messages(self) -> list[Message]:
        """The final conversation: the last branch's messages (empty when the agent never called)."""
        return self.branches[-1].messages if self.branches else []


class RewardError(ValueError):
    """The reward raised, or returned something that is not a score."""


@dataclass(frozen=True)
class Scores:
    """What the reward gave: a value per branch, and whether it scored branches one by one (a list)
    rather than the run (one number for all)."""

    values: list[float]
    per_branch: bool


def branch_rewards(fn: HarnessRewardFn, sample: Sample, result: HarnessResult) -> Scores | None:
    """Per branch, its reward: ``fn``'s float for every branch, its list (one per branch), or None
    (the run is left out). ``RewardError`` says in one line what was wrong."""
    try:
        value = fn(sample, result)
    except Exception as exc:
        at = raised_at(exc)
        where = f" at {at}" if at else ""
        raise RewardError(f"the reward raised {type(exc).__name__}{where}: {exc}") from None
    if value is None:
        return None
    n = len(result.branches)
    values = list(value) if isinstance(value, list | tuple) else [value] * n
    if len(values) != n:
        raise RewardError(f"the reward returned {len(values)} values for {n} branches")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise RewardError(f"the reward returned {v!r}: a finite number is needed")
    return Scores([float(v) for v in values], isinstance(value, list | tuple))
