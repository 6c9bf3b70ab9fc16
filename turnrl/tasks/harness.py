"""Tasks as the rows of a harness run (``env: {kind: harness}``): each run's folder made from its
row's task and shown to the agent at the task's working directory (``place``, which ``turnrl.app``
hands the harness), and the task's own tests as the reward (``env.reward: turnrl.tasks:reward``),
run in the run's sandbox once the agent ended, their output kept in the run's
``logs/verifier/output.txt``. The rows come from ``data: {generator: "turnrl.tasks:rows", kwargs:
{path: DIR}}``."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from turnrl.harness.result import HarnessResult
from turnrl.tasks.task import Task, load_task
from turnrl.tasks.workspace import Workspace
from turnrl.types import Sample


@functools.lru_cache(maxsize=4096)
def _task(path: str) -> Task:
    return load_task(path, container=True)  # one that needs a container: the run's checks say so


def task_of(sample: Sample) -> Task | None:
    """The task a row names (``metadata.task``, as ``rows`` writes it), or None."""
    path = sample.metadata.get("task") if isinstance(sample.metadata, dict) else None
    return _task(str(path)) if path else None


def place(sample: Sample, run_dir: Path) -> Workspace | None:
    """The run's place when its row is a task: its folder from the task's files, the task's view
    (no tests, no solution) and the task's time limit for the agent."""
    task = task_of(sample)
    return Workspace(task, run_dir) if task is not None else None


def reward(sample: Sample, result: HarnessResult) -> float:
    """The row's task's tests, run in the run's folder in its sandbox: the reward file they wrote
    (Harbor), else their exit code (SWE-style)."""
    task = task_of(sample)
    if task is None:
        raise ValueError(
            f"row {sample.id} names no task (metadata.task): data from turnrl.tasks:rows has one"
        )

    def run(argv: list[str], timeout: float, view: Any) -> Any:
        return result.run(argv, timeout, view=view)

    space = Workspace(task, result.folder.parent, run)
    verdict = space.verify()
    lines = [f"reward {verdict.reward:g}" + (f" ({verdict.why})" if verdict.why else ""), verdict.output]
    (space.logs / "verifier" / "output.txt").write_text("\n".join(lines), encoding="utf-8")
    return verdict.reward
