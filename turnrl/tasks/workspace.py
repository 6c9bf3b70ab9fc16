"""A task's run: its folder prepared from the task's files, commands run in it inside a runtime
(``turnrl.harness.runtime.Runtime``: the bubblewrap sandbox by default), and its tests turned into a
reward.

Inside the run, as in the task's container: the run's folder at the task's working directory
(``/app``), ``/logs/agent``, and for the test command only ``/logs/verifier`` (the reward file)
and the task's tests at ``/tests``; its solution at ``/solution`` for ``turnrl check-tasks`` only:
an agent never sees the tests, the solution or the verifier's folder."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from turnrl.harness.process import CommandResult, run_command
from turnrl.harness.runtime import Bind, Runtime, View
from turnrl.tasks.task import LOGS, REWARD_FILES, SOLUTION, TESTS, Task

Run = Callable[[list[str], float, View], CommandResult]  # (argv, timeout, view): run it in the run


def in_runtime(runtime: Runtime, folder: Path) -> Run:
    """How a run's commands run in ``runtime``, in ``folder`` (no gateway to call)."""

    def run(argv: list[str], timeout: float, view: View) -> CommandResult:
        return run_command(runtime.launch(argv, folder, {}, gateway=False, view=view), timeout)

    return run


@dataclass(frozen=True)
class Verdict:
    """What a task's tests said of a run's folder."""

    reward: float
    output: str  # the test command's stdout and stderr, their tails
    seconds: float
    why: str | None = None  # why the reward is 0 without the tests saying so (no reward file, timeout)

    @property
    def passed(self) -> bool:
        """The tests passed: a reward of 1 (or more)."""
        return self.reward >= 1.0


class Workspace:
    """The folder of one run of ``task`` under ``run_dir`` (``run_dir/work``, its logs in
    ``run_dir/logs``), and its commands, run by ``run`` (``in_runtime``; a harness run's own: its
    ``HarnessResult.run``). A harness ``Place``: what an agent sees of a task."""

    def __init__(
        self, task: Task, run_dir: Path, run: Run | None = None, runtime: Runtime | None = None
    ) -> None:
        self.task = task
        self.run_dir = run_dir
        self.folder = run_dir / "work"
        self.logs = run_dir / "logs"
        self._run = run
        self._runtime = runtime  # fills the folder from the task's image, where it has images

    @classmethod
    def in_runtime(cls, task: Task, run_dir: Path, runtime: Runtime) -> Workspace:
        """A workspace whose commands run in ``runtime`` (which ``prepare`` fills the folder with)."""
        return cls(task, run_dir, in_runtime(runtime, run_dir / "work"), runtime)

    @property
    def timeout_s(self) -> float:
        """The agent's time limit: the task's."""
        return self.task.agent_timeout_s

    def prepare(self) -> Path:
        """The run's folder, made from the task's files (its Dockerfile's copies, or the
        repository; in a container runtime, what its image holds at the working directory); the
        logs' folders beside it. Returns the folder."""
        self.folder.mkdir(parents=True)
        for sub in ("verifier", "agent"):
            (self.logs / sub).mkdir(parents=True)
        for copy in self.task.copies:
            target = (self.folder / copy.dest).resolve()
            if copy.source.is_dir():
                shutil.copytree(copy.source, target, symlinks=True, dirs_exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(copy.source, target)
        if self._runtime is not None:
            self._runtime.populate(self.folder, self.view())
        return self.folder

    def view(self, tests: bool = False, solution: bool = False) -> View:
        """The run as its commands see it: the folder at the task's working directory, the logs,
        and the tests or the solution when asked for."""
        # only the test command sees /logs/verifier: an agent that could write there could plant a
        # reward, or a link that the host would follow when it reads the reward back
        binds = [Bind(self.logs / "agent", f"{LOGS}/agent", writable=True)]
        if tests:
            binds.append(Bind(self.logs / "verifier", f"{LOGS}/verifier", writable=True))
        if tests and self.task.tests is not None:
            binds.append(Bind(self.task.tests, TESTS))
        if solution and self.task.solution is not None:
            binds.append(Bind(self.task.solution.parent, SOLUTION))
        variables = {**self.task.env, **(self.task.verifier_env if tests else {})}
        task = self.task
        return View(
            task.workdir,
            tuple(binds),
            tuple(variables.items()),
            task.dockerfile,
            task.image,
            task.needs_container,
        )

    def run(
        self,
        command: str,
        timeout: float,
        tests: bool = False,
        solution: bool = False,
    ) -> CommandResult:
        """``bash -c command`` in the run's folder, for at most ``timeout`` s."""
        if self._run is None:
            raise RuntimeError(f"this workspace of task {self.task.name} has nothing to run commands with")
        return self._run(["bash", "-c", command], timeout, self.view(tests, solution))

    def solve(self) -> CommandResult:
        """The task's own solution run in the folder (within the agent's timeout)."""
        if self.task.solution is None:
            raise ValueError(f"task {self.task.name} has no solution/solve.sh")
        return self.run(
            f"bash {SOLUTION}/{self.task.solution.name}", self.task.agent_timeout_s, solution=True
        )

    def verify(self) -> Verdict:
        """The task's tests run in the folder: the reward file they write (Harbor), else their exit
        code (SWE-style: 1.0 when 0)."""
        for name in REWARD_FILES:
            (self.logs / "verifier" / name).unlink(missing_ok=True)
        done = self.run(self.task.test_command, self.task.verifier_timeout_s, tests=True)
        output = (done.stdout + done.stderr)[-4000:]
        if done.timed_out:
            return Verdict(
                0.0, output, done.seconds, f"the tests ran past {self.task.verifier_timeout_s:g} s"
            )
        if not self.task.reward_file:
            return Verdict(float(done.exit_code == 0), output, done.seconds)
        reward, why = read_reward(self.logs / "verifier")
        return Verdict(reward, output, done.seconds, why)


def read_reward(folder: Path) -> tuple[float, str | None]:
    """The reward a Harbor verifier wrote in ``folder``: reward.txt (a number), else reward.json
    (its "reward", or its only value); 0.0 and why when there is none or it is not a number."""
    text = folder / "reward.txt"
    if text.is_file():
        return _number(text.read_text().strip(), "reward.txt")
    data = folder / "reward.json"
    if data.is_file():
        try:
            values = json.loads(data.read_text())
        except json.JSONDecodeError as exc:
            return 0.0, f"reward.json is not JSON ({exc})"
        if isinstance(values, dict):
            value = values.get("reward", next(iter(values.values())) if len(values) == 1 else None)
        else:
            value = values
        return _number(value, "reward.json")
    return 0.0, "the tests wrote no reward file (/logs/verifier/reward.txt or reward.json)"


def _number(value: object, source: str) -> tuple[float, str | None]:
    try:
        reward = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0, f"{source} holds {str(value)[:40]!r}, not a number"
    if not math.isfinite(reward):
        return 0.0, f"{source} holds {reward}, not a finite number"
    return reward, None
