"""Advantage estimators: from a batch of trajectories to one advantage per model turn.

Every estimator returns ``advantages[i][k]``: the advantage of model turn ``k`` of trajectory
``i``, given to every sampled token of that turn. Trajectories are compared within their group
(same ``group_id``: the same prompt, ``rollout.group_size`` samples of it).

- ``grpo``: ``A_i = (R_i - mean_g R) / (std_g R + eps)``, the same for every turn of ``i``
  (without std normalization, Dr. GRPO: ``A_i = R_i - mean_g R``). ``std`` is the sample
  standard deviation (n - 1), as in GRPO; a group of one gets 0.
- ``rloo``: leave-one-out, ``A_i = R_i - mean_{j != i} R_j``; never std-normalized.
- An agent harness run may leave several trajectories (its session's branches): for ``grpo`` and
  ``rloo`` the group's mean and std are over runs (one reward per sample index, ``run_reward``),
  and each branch is scored against them with its own reward (its run's, unless the reward gave
  per-branch values).
- ``reward_to_go`` (per-turn credit): turn ``k`` of ``i`` is credited with its return
  ``G_ik = R_i + sum_{k' >= k} gamma^(k' - k) r_ik'`` (the final reward plus the discounted env
  rewards of this and the later turns), and its baseline is the mean return of turn ``k``
  over the group's trajectories that have a turn ``k``:
  ``A_ik = (G_ik - mean_{j: k < T_j} G_jk) / (std_{j: k < T_j} G_jk + eps)``.
  A turn whose env step never came (the generation hit a limit) has ``r_ik = 0``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from turnrl.rollout.metrics import run_of, run_reward
from turnrl.types import Trajectory

TurnAdvantages = list[list[float]]
"""Per trajectory, per model turn: the advantage of that turn's tokens."""


@dataclass(frozen=True)
class AdvantageOptions:
    """Knobs shared by the estimators (each reads the ones it needs)."""

    normalize_std: bool = True  # divide by the group's std (grpo, reward_to_go)
    eps: float = 1e-6  # added to the std
    gamma: float = 1.0  # discount over later turns (reward_to_go)


Estimator = Callable[[Sequence[Trajectory], AdvantageOptions], TurnAdvantages]
ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: make an estimator usable as ``algorithm.advantage: name``."""

    def add(fn: Estimator) -> Estimator:
        ESTIMATORS[name] = fn
        return fn

    return add


def compute_advantages(
    name: str, trajs: Sequence[Trajectory], options: AdvantageOptions | None = None
) -> TurnAdvantages:
    """The advantages of ``trajs`` by the estimator registered as ``name``."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r} (known: {', '.join(sorted(ESTIMATORS))})")
    return ESTIMATORS[name](trajs, options or AdvantageOptions())


def groups(trajs: Sequence[Trajectory]) -> dict[str, list[int]]:
    """Indices of the trajectories of each group, in order."""
    out: dict[str, list[int]] = {}
    for i, traj in enumerate(trajs):
        out.setdefault(traj.group_id, []).append(i)
    return out


def normalize(values: Sequence[float], normalize_std: bool, eps: float) -> list[float]:
    """``values`` minus their mean, optionally over their sample std plus ``eps`` (one value: 0)."""
    if len(values) < 2:
        return [0.0] * len(values)
    mean = statistics.fmean(values)
    scale = statistics.stdev(values) + eps if normalize_std else 1.0
    return [(v - mean) / scale for v in values]


def _per_turn(traj: Trajectory, value: float) -> list[float]:
    """``value`` for every model turn of ``traj``."""
    return [value] * traj.num_turns


def run_rewards(trajs: Sequence[Trajectory], members: list[int]) -> dict[tuple[str, int] | int, float]:
    """Per run of a group (``run_of``), the run's reward: the baseline is over runs, however many
    branches each left."""
    out: dict[tuple[str, int] | int, float] = {}
    for i in members:
        out.setdefault(run_of(trajs[i]), run_reward(trajs[i]))
    return out


@register_estimator("grpo")
def grpo(trajs: Sequence[Trajectory], options: AdvantageOptions) -> TurnAdvantages:
    """Group-normalized final rewards, the same for every turn of a trajectory."""
    out: TurnAdvantages = [[] for _ in trajs]
    for members in groups(trajs).values():
        runs = list(run_rewards(trajs, members).values())
        for i in members:
            score = 0.0
            if len(runs) > 1:
                scale = statistics.stdev(runs) + options.eps if options.normalize_std else 1.0
                score = (trajs[i].score - statistics.fmean(runs)) / scale
            out[i] = _per_turn(trajs[i], score)
    return out


@register_estimator("rloo")
def rloo(trajs: Sequence[Trajectory], options: AdvantageOptions) -> TurnAdvantages:
    """Final reward minus the mean reward of the rest of the group (0 in a group of one)."""
    out: TurnAdvantages = [[] for _ in trajs]
    for members in groups(trajs).values():
        runs = run_rewards(trajs, members)
        total, n = sum(runs.values()), len(runs)
        for i in members:
            others = (total - runs[run_of(trajs[i])]) / (n - 1) if n > 1 else 0.0
            out[i] = _per_turn(trajs[i], trajs[i].score - others if n > 1 else 0.0)
    return out


def returns(traj: Trajectory, gamma: float) -> list[float]:
    """Per model turn: the final reward plus the discounted env rewards of this and later turns."""
    rewards = list(traj.turn_rewards[: traj.num_turns])
    rewards += [0.0] * (traj.num_turns - len(rewards))
    out, later = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        later = rewards[k] + gamma * later
        out[k] = traj.score + later
    return out


@register_estimator("reward_to_go")
def reward_to_go(trajs: Sequence[Trajectory], options: AdvantageOptions) -> TurnAdvantages:
    """Per-turn credit: each turn's return, normalized against the same turn of the group."""
    out: TurnAdvantages = [[] for _ in trajs]
    for members in groups(trajs).values():
        rets = {i: returns(trajs[i], options.gamma) for i in members}
        for i in members:
            out[i] = [0.0] * len(rets[i])
        for k in range(max((len(r) for r in rets.values()), default=0)):
            have = [i for i in members if k < len(rets[i])]
            scores = normalize([rets[i][k] for i in have], options.normalize_std, options.eps)
            for i, score in zip(have, scores, strict=True):
                out[i][k] = score
    return out
