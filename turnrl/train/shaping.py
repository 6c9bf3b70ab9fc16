"""DAPO's batch shaping, as options of a training step: overlong reward shaping and filtering, and
dynamic sampling (drop groups with nothing to learn, roll out more prompts to refill the batch).

- **Overlong shaping** (``algorithm.overlong``): a trajectory whose model tokens ``L`` pass
  ``max_tokens - buffer`` loses reward linearly, ``penalty * (max_tokens - buffer - L) / buffer``,
  down to ``-penalty`` at ``max_tokens`` and beyond (DAPO's soft overlong punishment, counted
  over the model's tokens of every turn). With ``mask_truncated``, a trajectory cut by a length
  limit (``length``, ``token_budget``) carries no loss at all (DAPO's overlong filtering): its
  end is not the model's answer, so it teaches neither way.
- **Dynamic sampling** (``algorithm.dynamic_sampling``): a GRPO group whose rewards are all equal
  has zero advantages, so it only thins the batch. Such groups are dropped, and more prompts (not
  yet in the step, drawn with the step's seed) are rolled out, round after round, until the step
  has ``prompts_per_step`` groups with varied rewards or ``max_rounds`` rounds were rolled out;
  each round asks for as many prompts as the rate of kept groups so far says it needs.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from turnrl.train.advantages import groups
from turnrl.types import Sample, StopReason, Trajectory

CUT_BY_LENGTH = frozenset({StopReason.LENGTH, StopReason.TOKEN_BUDGET})


def overlong_penalty(model_tokens: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of a response of ``model_tokens`` (0.0 up to
    ``max_tokens - buffer``; ``-penalty`` from ``max_tokens`` on)."""
    if model_tokens >= max_tokens:
        return -penalty
    start = max_tokens - buffer
    if buffer <= 0 or model_tokens <= start:
        return 0.0
    return penalty * (start - model_tokens) / buffer


def shape_overlong(
    trajs: Sequence[Trajectory], max_tokens: int, buffer: int, penalty: float, mask_truncated: bool
) -> tuple[list[Trajectory], dict[str, float]]:
    """The trajectories with overlong penalties added to their rewards (and, with
    ``mask_truncated``, those cut by a length limit without loss); their counts."""
    out, penalized, total, masked = [], 0, 0.0, 0
    for traj in trajs:
        cut = overlong_penalty(sum(traj.loss_mask), max_tokens, buffer, penalty)
        if cut:
            penalized += 1
            total += cut
            traj = dataclasses.replace(traj, reward=traj.score + cut)
        if mask_truncated and traj.stop_reason in CUT_BY_LENGTH:
            masked += 1
            traj = dataclasses.replace(traj, loss_mask=[0] * len(traj.loss_mask))
        out.append(traj)
    metrics = {
        "overlong/penalized": float(penalized),
        "overlong/penalty_mean": total / len(trajs) if trajs else 0.0,
        "overlong/masked": float(masked),
    }
    return out, metrics


def varied_groups(trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
    """The trajectories of groups whose rewards differ, and how many groups had all-equal rewards."""
    kept: list[Trajectory] = []
    flat = 0
    for members in groups(trajs).values():
        rewards = {trajs[i].score for i in members}
        if len(rewards) > 1:
            kept += [trajs[i] for i in members]
        else:
            flat += 1
    return kept, flat


def refill_prompts(pool: Sequence[Sample], count: int, seed: int, step: int, round_: int) -> list[Sample]:
    """``count`` prompts of ``pool`` (those not yet in the step), drawn with the step's seed and round."""
    order = list(pool)
    random.Random(f"{seed}/{step}/refill/{round_}").shuffle(order)
    return order[:count]


def refill_count(needed: int, kept: int, tried: int) -> int:
    """Prompts to roll out for ``needed`` more varied groups, at the kept rate so far (at least a
    quarter, so a run of flat groups does not ask for the whole data set)."""
    rate = max(kept / tried, 0.25) if tried else 1.0
    return math.ceil(needed / rate)
