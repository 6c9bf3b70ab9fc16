"""The training progress bars: steps done, and trajectories of the current rollout or evaluation."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn

from turnrl.rollout.collector import starts_a_run
from turnrl.support.progress import LoggedProgress
from turnrl.types import Trajectory


class TrainProgress:
    """Two bars under the per-step lines: training steps, and the current phase's trajectories."""

    def __init__(self, console: Console, steps: int, done: int) -> None:
        self._progress = LoggedProgress(
            TextColumn("[bold]{task.description:<18}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self._steps: TaskID = self._progress.add_task("train steps", total=steps, completed=done)
        self._trajectories: TaskID = self._progress.add_task("trajectories", total=0, visible=False)

    def __enter__(self) -> TrainProgress:
        self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def phase(self, name: str, total: int) -> None:
        """Start counting ``total`` trajectories of a rollout or evaluation called ``name``."""
        self._progress.reset(self._trajectories, total=total, description=name, visible=True)

    def trajectory_done(self, trajectory: Trajectory) -> None:
        """One more trajectory of the current phase has finished (an agent harness run's later
        branches are not counted: its run was)."""
        if starts_a_run(trajectory):
            self._progress.advance(self._trajectories)

    def advance(self) -> None:
        """One more unit of the current phase (an optimizer step of the warm start) is done."""
        self._progress.advance(self._trajectories)

    def step_done(self, step: int) -> None:
        """Training step ``step`` is done."""
        self._progress.update(self._steps, completed=step)
