"""The turn loop and the collector."""

from turnrl.rollout.collector import collect, iter_trajectories, read_trajectories
from turnrl.rollout.loop import Limits, RolloutSpec, run_trajectory
from turnrl.rollout.metrics import summarize

__all__ = [
    "Limits",
    "RolloutSpec",
    "collect",
    "iter_trajectories",
    "read_trajectories",
    "run_trajectory",
    "summarize",
]
