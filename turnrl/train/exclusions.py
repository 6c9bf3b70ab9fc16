"""What a training step leaves out, and why: failed trajectories, groups with nothing to learn.

An engine that died, an env that crashed, a bug: none of these is the model's doing, so their
trajectories are not trained on as reward 0 (that would be negative signal for whatever the model
did up to the failure); they leave the step before advantages, so they do not weigh on their
group's baseline either (``algorithm.train_on_failures: true`` keeps them). Every exclusion is
counted in the step's metrics by reason, as are groups whose advantages are all zero (every member
scored the same, or a single member: GRPO has nothing to learn from them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from turnrl.rollout.failures import FAILURES
from turnrl.train.advantages import TurnAdvantages, groups
from turnrl.train.batch import TrainSample
from turnrl.types import Trajectory

__all__ = ["FAILURES", "exclude_failures", "exclusion_metrics", "forest_metrics"]


def exclude_failures(trajs: Sequence[Trajectory], keep: bool) -> tuple[list[Trajectory], Counter[str]]:
    """The trajectories to train on, and how many were left out per stop reason (failures: none when
    ``keep``) or per the reason a trajectory gives in ``exclude`` (an agent harness's branches not
    to train: ``not_reinforced``, ``reward_none``, ``unchosen``)."""
    marked = Counter(t.exclude for t in trajs if t.exclude)
    trajs = [t for t in trajs if not t.exclude]
    if keep:
        return list(trajs), marked
    left_out = Counter(t.stop_reason.value for t in trajs if t.stop_reason in FAILURES)
    return [t for t in trajs if t.stop_reason not in FAILURES], left_out + marked


def exclusion_metrics(
    trajs: Sequence[Trajectory],
    advantages: TurnAdvantages,
    samples: Sequence[TrainSample],
    excluded: Counter[str],
) -> dict[str, float]:
    """``train/excluded/<reason>`` per left-out trajectory kind, trajectories without a model token,
    samples and groups whose advantages are all zero."""
    out: dict[str, float] = {f"train/excluded/{reason}": n for reason, n in sorted(excluded.items())}
    out["train/excluded/no_model_tokens"] = sum(1 for t in trajs if not (t.prompt_ids and any(t.loss_mask)))

    out["train/zero_advantage_samples"] = sum(1 for s in samples if not any(s.advantages))
    flat = [all(v == 0 for v in turn_advantages) for turn_advantages in advantages]
    members = groups(trajs).values()
    out["train/zero_advantage_groups"] = sum(1 for group in members if all(flat[i] for i in group))
    out["train/groups"] = len(members)
    return out


def forest_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Over the step's agent session branches (``turnrl.gateway.forest``): the tokens of replies the
    agent did not go on from (not trained), and the sampled tokens branches hold as context because
    another branch trains them (``train/trunk_tokens``). Empty when no branch says."""
    branches = [t.branch for t in trajs if t.branch is not None]
    if not branches:
        return {}
    return {
        "train/excluded/unchosen_tokens": sum(b.unchosen_tokens for b in branches),
        "train/trunk_tokens": sum(b.trunk_tokens for b in branches),
    }
