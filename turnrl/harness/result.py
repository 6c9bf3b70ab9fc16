"""What a harness run left, as its reward sees it (``HarnessResult``); how it is scored is ``scoring``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.harness.process import CommandResult
from turnrl.harness.runtime import View
from turnrl.types import Message, Sample, Trajectory

HarnessRewardFn = Callable[[Sample, "HarnessResult"], Any]
CommandRunner = Callable[[list[str], float, View | None], CommandResult]


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

    def run(
        self, command: str | list[str], timeout_s: float = 600.0, view: View | None = None
    ) -> CommandResult:
        """Run ``command`` (a shell line, or an argv) in the run's folder, in the run's sandbox (as the
        agent ran: the same view, limits and no network; ``view``: another one, a task's tests
        shown), after the agent ended. Blocking (the reward runs in a thread of its own); everything
        it starts ends with it."""
        if self.runner is None:
            raise RuntimeError("this result has no runtime to run commands in")
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        result = self.runner(argv, timeout_s, view)
        self.commands.append(
            {"command": command, "exit_code": result.exit_code, "seconds": round(result.seconds, 3)}
        )
        return result

    @property
    def messages(self) -> list[Message]:
        """The final conversation: the last branch's messages (empty when the agent never called)."""
        return self.branches[-1].messages if self.branches else []
