"""A training run's state: the learner (policy, optimizer), the engine that rolls out, the data,
and where the run writes and reports. ``app.training`` builds it from a config."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from turnrl.rollout.collector import OnDone
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.heap import learner_thread
from turnrl.train.config import TrainConfig
from turnrl.train.data_parallel import Ranks
from turnrl.train.progress import TrainProgress
from turnrl.train.update import Learner
from turnrl.types import Engine, Sample


@dataclass
class Data:
    """The run's prompts: to train on, held out, and to warm-start from (``warm_start.data``)."""

    train: list[Sample]
    held_out: list[Sample] = field(default_factory=list)
    warm_start: list[Sample] = field(default_factory=list)


@dataclass
class Run:
    """A training run: what the steps share."""

    learner: Learner
    engine: Engine  # the embedded engine (its own copy of the weights) or vLLM servers
    spec: RolloutSpec  # how a trajectory is rolled out (sampling, limits, env, rewards)
    data: Data
    out_dir: Path
    console: Console = field(default_factory=lambda: Console(stderr=True))  # where the run reports
    step: int = 0  # training steps done
    resumed: bool = False  # restored from a checkpoint (the step-0 evaluation and warm start are done)
    progress: TrainProgress | None = None  # the console's progress bars, while training runs
    weights_dir: Path | None = None  # where weight updates for server engines are written
    pushed: dict[str, Any] | None = None  # the state dict a collective push sends (the first rank's)
    updates: ThreadPoolExecutor = field(default_factory=learner_thread)  # every step's update runs here

    @property
    def config(self) -> TrainConfig:
        """The run's config."""
        config = self.learner.config
        assert isinstance(config, TrainConfig), "a training run's learner holds its TrainConfig"
        return config

    @property
    def ranks(self) -> Ranks:
        """This process among the data-parallel training processes."""
        return self.learner.ranks

    @property
    def policy(self) -> Any:
        """The trained model."""
        return self.learner.policy

    def phase(self, name: str, total: int) -> OnDone | None:
        """Show a phase of ``total`` trajectories; the callback that counts them."""
        if self.progress is None:
            return None
        self.progress.phase(name, total)
        return self.progress.trajectory_done
