"""``turnrl check-tasks DIR``: is each task a task to train on? Its tests must fail on the folder
as the task leaves it (else there is nothing to do) and pass once its own solution has run there
(else no agent can pass them), each in a fresh run of the sandbox, timed."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from turnrl.config import SandboxConfig
from turnrl.harness.container import PodmanRuntime
from turnrl.harness.runtime import Runtime
from turnrl.harness.sandbox import BubblewrapRuntime
from turnrl.support.errors import describe
from turnrl.tasks.task import Task
from turnrl.tasks.workspace import Verdict, Workspace


@dataclass(frozen=True)
class TaskCheck:
    """One task's check: its tests on the untouched folder, then after its solution."""

    task: str
    untouched: Verdict | None
    solved: Verdict | None
    solve_seconds: float
    problem: str | None  # why the task is one to drop (None: keep it)
    seconds: float

    @property
    def ok(self) -> bool:
        return self.problem is None


def task_runtime(
    task: Task, root: Path, podman: Sequence[str] | None = None, image: str | None = None
) -> Runtime:
    """The runtime of ``task``'s checks under ``root`` (no network; its memory from task.toml): the
    local sandbox, or ``podman`` (a command) running it in containers of its image (``image``: of a
    task without one, a SWE-style task)."""
    memory = SandboxConfig().memory_mb if task.memory_mb is None else max(64, int(task.memory_mb))
    if podman is not None:
        config = SandboxConfig(memory_mb=memory, runtime="podman", podman=list(podman), image=image)
        return PodmanRuntime(config, hidden=[root])
    return BubblewrapRuntime(SandboxConfig(memory_mb=memory), hidden=[root])


def check_task(task: Task, root: Path, runtime: Callable[[Task, Path], Runtime] = task_runtime) -> TaskCheck:
    """Check ``task`` in two fresh runs under ``root``."""
    t0 = time.monotonic()
    untouched = solved = None
    solve_seconds = 0.0
    try:
        box = runtime(task, root)
        shutil.rmtree(root / task.name, ignore_errors=True)  # a kept check of an earlier call
        first = Workspace.in_runtime(task, root / task.name / "untouched", box)
        first.prepare()
        untouched = first.verify()
        if task.solution is None:
            return _done(task, untouched, None, 0.0, "no solution/solve.sh to check the tests with", t0)
        second = Workspace.in_runtime(task, root / task.name / "solved", box)
        second.prepare()
        solve = second.solve()
        solve_seconds = solve.seconds
        solved = second.verify()
        # a solution that exits non-zero after fixing the folder is fine: the tests decide
        problem = _problem(untouched, solved, solve.exit_code, solve.timed_out, task)
        return _done(task, untouched, solved, solve_seconds, problem, t0)
    except Exception as exc:  # the sandbox or a copy failed: say so for this task, check the rest
        return _done(task, untouched, solved, solve_seconds, f"could not run: {describe(exc)}", t0)


def _problem(
    untouched: Verdict, solved: Verdict, code: int | None, timed_out: bool, task: Task
) -> str | None:
    if untouched.passed:
        return "its tests pass on the untouched folder"
    if timed_out:
        return f"its solution ran past the agent's timeout ({task.agent_timeout_s:g} s)"
    if not solved.passed:
        why = solved.why or f"reward {solved.reward:g}"
        return f"its tests fail after its solution (exit {code}): {why}"
    return None


def _done(
    task: Task,
    untouched: Verdict | None,
    solved: Verdict | None,
    solve_s: float,
    problem: str | None,
    t0: float,
) -> TaskCheck:
    return TaskCheck(task.name, untouched, solved, solve_s, problem, time.monotonic() - t0)


def check_tasks(
    tasks: list[Task],
    keep: Path | None = None,
    podman: Sequence[str] | None = None,
    image: str | None = None,
) -> Iterator[TaskCheck]:
    """Each task checked in turn (yielded as it ends); the runs' folders kept under ``keep``, else
    removed; ``podman``, ``image``: in containers of each task's image (``task_runtime``)."""
    root = Path(tempfile.mkdtemp(prefix="turnrl-tasks-")) if keep is None else keep
    root.mkdir(parents=True, exist_ok=True)
    runtimes: dict[tuple[int | None, ...], Runtime] = {}  # one a memory size: a podman's image cache

    def runtime(task: Task, root: Path) -> Runtime:
        key = (task.memory_mb,)
        if key not in runtimes:
            runtimes[key] = task_runtime(task, root, podman, image)
        return runtimes[key]

    try:
        for task in tasks:
            yield check_task(task, root, runtime)
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def describe_check(check: TaskCheck) -> str:
    """One line for ``check``: keep or drop, what each run of the tests said, and the times."""
    parts = []
    if check.untouched is not None:
        said = "pass" if check.untouched.passed else "fail"
        parts.append(f"untouched: {said} ({check.untouched.seconds:.2f} s)")
    if check.solved is not None:
        said = "pass" if check.solved.passed else "fail"
        parts.append(
            f"solved: {said} (solution {check.solve_seconds:.2f} s, tests {check.solved.seconds:.2f} s)"
        )
    verdict = "keep" if check.ok else f"drop: {check.problem}"
    return f"{check.task}: {verdict}; " + ", ".join(parts) + f"; {check.seconds:.2f} s in all"


def check_record(check: TaskCheck) -> dict[str, object]:
    """``check`` as a JSON object (``turnrl check-tasks --out``)."""

    def verdict(v: Verdict | None) -> dict[str, object] | None:
        if v is None:
            return None
        return {
            "reward": v.reward,
            "passed": v.passed,
            "seconds": v.seconds,
            "why": v.why,
            "output": v.output,
        }

    return {
        "task": check.task,
        "keep": check.ok,
        "problem": check.problem,
        "untouched": verdict(check.untouched),
        "solved": verdict(check.solved),
        "solve_seconds": check.solve_seconds,
        "seconds": check.seconds,
    }
