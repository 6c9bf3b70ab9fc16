"""The turn loop, its episode state and record, the collector, and pause/resume control."""

from turnrl.record.codec import trajectory_from_json, trajectory_to_json
from turnrl.rollout.collector import collect, iter_trajectories, read_trajectories
from turnrl.rollout.control import RolloutControl
from turnrl.rollout.loop import run_trajectory
from turnrl.rollout.metrics import summarize
from turnrl.rollout.spec import RolloutSpec, TurnHook
from turnrl.types import Limits

__all__ = [
    "Limits",
    "RolloutControl",
    "RolloutSpec",
    "TurnHook",
    "collect",
    "iter_trajectories",
    "read_trajectories",
    "run_trajectory",
    "summarize",
    "trajectory_from_json",
    "trajectory_to_json",
]
