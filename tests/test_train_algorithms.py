"""Advantage estimators and policy losses against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from turnrl.train.advantages import ESTIMATORS, AdvantageOptions, compute_advantages, returns
from turnrl.train.loss import (
    POLICY_LOSSES,
    LossInputs,
    LossOptions,
    importance_stats,
    kl_k3,
    policy_loss,
)
from turnrl.types import StopReason, Trajectory, Turn


def traj(group: str, reward: float, turn_rewards: list[float] | None = None, turns: int = 1) -> Trajectory:
    """A trajectory with ``turns`` model turns of one token each (no env tokens)."""
    return Trajectory(
        id=f"{group}/x",
        group_id=group,
        data_source="t",
        stop_reason=StopReason.ENV_DONE,
        prompt_ids=[1],
        response_ids=[2] * turns,
        loss_mask=[1] * turns,
        rollout_logprobs=[-1.0] * turns,
        turns=[Turn("assistant", k, k + 1, "a") for k in range(turns)],
        messages=[],
        reward=reward,
        turn_rewards=turn_rewards or [],
        num_turns=turns,
    )


def value(t: torch.Tensor) -> float:
    """A scalar tensor as a float, without its graph."""
    return float(t.detach())


def flat(rows: list[list[float]]) -> list[float]:
    """Nested lists flattened (pytest.approx compares flat sequences)."""
    return [x for row in rows for x in row]


def test_registries_hold_the_variants() -> None:
    assert {"grpo", "rloo", "reward_to_go"} <= set(ESTIMATORS)
    assert {"ppo", "pg", "cispo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages("nope", [])
    with pytest.raises(ValueError, match="unknown loss"):
        policy_loss("nope", LossInputs(*[torch.zeros(1, 1)] * 5), LossOptions())


def test_grpo_normalizes_within_each_group() -> None:
    trajs = [traj("a", 1), traj("a", 0, turns=2), traj("b", 5), traj("a", 0), traj("a", 1)]
    # group a: rewards 1, 0, 0, 1 -> mean 0.5, sample std sqrt(1/3); group b has one member -> 0
    got = compute_advantages("grpo", trajs, AdvantageOptions(normalize_std=True, eps=0.0))
    z = 0.5 / math.sqrt(1 / 3)
    assert got == [
        [pytest.approx(z)],
        [pytest.approx(-z)] * 2,
        [0.0],
        [pytest.approx(-z)],
        [pytest.approx(z)],
    ]
    raw = compute_advantages("grpo", trajs, AdvantageOptions(normalize_std=False))
    assert raw == [[0.5], [-0.5, -0.5], [0.0], [-0.5], [0.5]]


def test_grpo_group_with_equal_rewards_gets_zero() -> None:
    got = compute_advantages("grpo", [traj("a", 1), traj("a", 1)], AdvantageOptions())
    assert got == [[0.0], [0.0]]


def test_rloo_is_leave_one_out() -> None:
    got = compute_advantages("rloo", [traj("a", 1), traj("a", 0), traj("a", 0)])
    assert got == [[1.0], [-0.5], [-0.5]]


def test_returns_are_final_reward_plus_discounted_turn_rewards() -> None:
    # turn rewards 0.5, 0 (gamma 0.5): turn 1: 1 + 0 = 1; turn 0: 1 + 0.5 + 0.5 * 0 = 1.5
    assert returns(traj("a", 1.0, [0.5, 0.0], turns=2), gamma=0.5) == pytest.approx([1.5, 1.0])
    # the last turn had no env step (hit a limit): its turn reward is 0
    assert returns(traj("a", 2.0, [1.0], turns=2), gamma=1.0) == pytest.approx([3.0, 2.0])


def test_reward_to_go_baselines_each_turn_index() -> None:
    trajs = [
        traj("g", 1.0, [0.5, 0.0], turns=2),  # returns 1.5, 1.0
        traj("g", 0.0, [1.0], turns=1),  # returns 1.0
        traj("g", 2.0, [0.0, 0.0], turns=3),  # returns 2, 2, 2
    ]
    opts = AdvantageOptions(normalize_std=True, eps=0.0, gamma=0.5)
    got = compute_advantages("reward_to_go", trajs, opts)
    # turn 0: 1.5, 1.0, 2.0 -> mean 1.5, std 0.5; turn 1: 1.0, 2.0 -> mean 1.5, std sqrt(0.5); turn 2: alone
    s = 0.5 / math.sqrt(0.5)
    assert flat(got) == pytest.approx([0.0, -s, -1.0, 1.0, s, 0.0])
    assert [len(a) for a in got] == [2, 1, 3]
    raw = compute_advantages("reward_to_go", trajs, AdvantageOptions(normalize_std=False, gamma=0.5))
    assert flat(raw) == pytest.approx([0.0, -0.5, -0.5, 0.5, 0.5, 0.0])


def inputs(
    ratio: list[float],
    adv: list[float],
    rollout_ratio: list[float] | None = None,
    mask: list[float] | None = None,
) -> LossInputs:
    """One row: old logprobs 0, new logprobs log(ratio) (a leaf), rollout = old - log(rollout_ratio)."""
    logp = torch.log(torch.tensor([ratio])).requires_grad_(True)
    old = torch.zeros_like(logp)
    rollout = -torch.log(torch.tensor([rollout_ratio or [1.0] * len(ratio)]))
    keep = torch.tensor([mask or [1.0] * len(ratio)])
    return LossInputs(logp, old, rollout, torch.tensor([adv]), keep)


def test_ppo_clip_by_hand() -> None:
    x = inputs([1.5, 0.5, 1.1], [1.0, 1.0, -1.0])
    out = policy_loss("ppo", x, LossOptions(clip_low=0.2, clip_high=0.2))
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5; token 2: 1.1
    assert value(out.loss) == pytest.approx((-1.2 - 0.5 + 1.1) / 3)
    assert out.clipped == 1 and out.tokens == 3
    out.loss.backward()
    assert x.logprobs_B_T.grad is not None
    # d/dlogp of -r A / 3 is -r A / 3; zero where the clip is active
    assert flat(x.logprobs_B_T.grad.tolist()) == pytest.approx([0.0, -0.5 / 3, 1.1 / 3])


def test_ppo_asymmetric_clip() -> None:
    x = inputs([1.25], [1.0])
    assert value(policy_loss("ppo", x, LossOptions(clip_high=0.28)).loss) == pytest.approx(-1.25)
    assert value(policy_loss("ppo", x, LossOptions(clip_high=0.2)).loss) == pytest.approx(-1.2)


def test_pg_and_cispo_by_hand() -> None:
    x = inputs([1.5, 0.5], [1.0, -2.0])
    assert value(policy_loss("pg", x, LossOptions()).loss) == pytest.approx((-1.5 + 1.0) / 2)
    out = policy_loss("cispo", x, LossOptions(clip_low=0.2, clip_high=0.2))
    # weights clip(1.5) = 1.2, clip(0.5) = 0.8, detached: loss = -(1.2 * 1 * log 1.5 + 0.8 * -2 * log 0.5) / 2
    expected = -(1.2 * math.log(1.5) + 0.8 * -2.0 * math.log(0.5)) / 2
    assert value(out.loss) == pytest.approx(expected)
    assert out.clipped == 2
    out.loss.backward()
    assert x.logprobs_B_T.grad is not None
    assert flat(x.logprobs_B_T.grad.tolist()) == pytest.approx([-1.2 / 2, 1.6 / 2])


def test_truncated_importance_sampling_by_hand() -> None:
    x = inputs([1.5, 0.5, 1.1], [1.0, 1.0, -1.0], rollout_ratio=[3.0, 1.0, 0.5])
    out = policy_loss("ppo", x, LossOptions(importance="tis", tis_cap=2.0))
    # weights min(3, 2) = 2, 1, 0.5 on the per-token PPO losses -1.2, -0.5, 1.1
    assert value(out.loss) == pytest.approx((-1.2 * 2 - 0.5 + 1.1 * 0.5) / 3)
    out.loss.backward()
    assert x.logprobs_B_T.grad is not None
    assert flat(x.logprobs_B_T.grad.tolist()) == pytest.approx([0.0, -0.5 / 3, 1.1 * 0.5 / 3])


def test_masked_importance_sampling_by_hand() -> None:
    x = inputs([1.5, 0.5, 1.1], [1.0, 1.0, -1.0], rollout_ratio=[3.0, 1.0, 0.5])
    out = policy_loss("ppo", x, LossOptions(importance="mis", mis_low=0.5, mis_high=2.0))
    # ratio 3 is outside [0.5, 2]: dropped; the normalizer stays 3
    assert value(out.loss) == pytest.approx((-0.5 + 1.1) / 3)
    stats = importance_stats(
        x.old_logprobs_B_T, x.rollout_logprobs_B_T, x.mask_B_T, LossOptions(importance="mis")
    )
    assert stats["is/ratio_max"] == pytest.approx(3.0) and stats["is/ratio_min"] == pytest.approx(0.5)
    assert stats["is/ratio_mean"] == pytest.approx(1.5)


def test_importance_stats_fraction_capped_by_tis() -> None:
    x = inputs([1.0, 1.0], [0.0, 0.0], rollout_ratio=[3.0, 1.0])
    opts = LossOptions(importance="tis", tis_cap=2.0)
    stats = importance_stats(x.old_logprobs_B_T, x.rollout_logprobs_B_T, x.mask_B_T, opts)
    assert stats["is/corrected_frac"] == pytest.approx(0.5)


def test_kl_k3_by_hand() -> None:
    logp = torch.tensor([[math.log(0.25)]])
    ref = torch.tensor([[math.log(0.5)]])  # d = log 2: k3 = 2 - log 2 - 1
    assert float(kl_k3(logp, ref)) == pytest.approx(1 - math.log(2))
    x = inputs([1.0], [0.0])
    x.ref_logprobs_B_T = x.logprobs_B_T.detach() + math.log(2)
    out = policy_loss("ppo", x, LossOptions(kl_coef=0.1))
    assert value(out.loss) == pytest.approx(0.1 * (1 - math.log(2)))
    assert out.kl_sum == pytest.approx(1 - math.log(2))


def test_normalizer_makes_micro_batches_add_up() -> None:
    full = inputs([1.5, 0.5, 1.1, 0.9], [1.0, 1.0, -1.0, 2.0])
    whole = value(policy_loss("ppo", full, LossOptions()).loss)
    parts = [inputs([1.5, 0.5], [1.0, 1.0]), inputs([1.1, 0.9], [-1.0, 2.0])]
    summed = sum(value(policy_loss("ppo", p, LossOptions(), normalizer=4).loss) for p in parts)
    assert summed == pytest.approx(whole)


def test_masked_tokens_get_exactly_zero_gradient() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 5))
    adv = torch.randn(2, 5)
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    for name in POLICY_LOSSES:
        for importance in ("none", "tis", "mis"):
            logits.grad = None
            logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
            garbage = torch.where(mask > 0, logp.detach(), torch.full_like(logp, -1e4))  # padding values
            x = LossInputs(logp, garbage, garbage - 0.1, adv, mask, garbage + 0.3)
            policy_loss(name, x, LossOptions(importance=importance, kl_coef=0.5)).loss.backward()
            assert logits.grad is not None and torch.isfinite(logits.grad).all()
            assert (logits.grad[mask == 0] == 0).all()
            assert (logits.grad[mask == 1].abs().sum(-1) > 0).all()
