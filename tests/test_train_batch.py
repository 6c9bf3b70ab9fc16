"""Trajectories into samples and padded tensors, per trajectory and per turn (step-wise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from turnrl.models import load_model
from turnrl.train.batch import build_samples, collate, micro_batches, unexpected_versions
from turnrl.train.logprobs import token_logprobs
from turnrl.train.loss import LossInputs, LossOptions, policy_loss
from turnrl.types import StopReason, Trajectory, Turn


def two_turn(tid: str = "g/0", reward: float = 1.0) -> Trajectory:
    """Prompt 10 11 12; model 20 21; env 30 31 32; model 22 23 24 (23 masked off-policy)."""
    return Trajectory(
        id=tid,
        group_id="g",
        data_source="t",
        prompt_ids=[10, 11, 12],
        response_ids=[20, 21, 30, 31, 32, 22, 23, 24],
        loss_mask=[1, 1, 0, 0, 0, 1, 0, 1],
        rollout_logprobs=[-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, 0.0, -0.5],
        turns=[
            Turn("assistant", 0, 2, "a"),
            Turn("user", 2, 5, "obs"),
            Turn("assistant", 5, 8, "b"),
        ],
        messages=[],
        reward=reward,
        stop_reason=StopReason.ENV_DONE,
        num_turns=2,
    )


def failed_start() -> Trajectory:
    return Trajectory("h/0", "h", "t", StopReason.ENV_ERROR)


def test_trajectory_mode_keeps_the_whole_sequence() -> None:
    (sample,) = build_samples("trajectory", [two_turn(), failed_start()], [[0.5, -2.0], []])
    assert sample.input_ids == [10, 11, 12, 20, 21, 30, 31, 32, 22, 23, 24]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1]
    assert sample.rollout_logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, 0, -0.3, 0, -0.5]
    assert sample.advantages == [0, 0, 0, 0.5, 0.5, 0, 0, 0, -2.0, 0, -2.0]


def test_turn_mode_gives_each_model_turn_its_exact_context() -> None:
    first, second = build_samples("turn", [two_turn()], [[0.5, -2.0]])
    assert (first.turn, second.turn) == (0, 1)
    assert first.input_ids == [10, 11, 12, 20, 21]
    assert first.loss_mask == [0, 0, 0, 1, 1]
    assert first.advantages == [0, 0, 0, 0.5, 0.5]
    assert second.input_ids == [
        10,
        11,
        12,
        20,
        21,
        30,
        31,
        32,
        22,
        23,
        24,
    ]  # what the engine saw, then the turn
    assert second.loss_mask == [0] * 8 + [1, 0, 1]
    assert second.rollout_logprobs == [0.0] * 8 + [-0.3, 0.0, -0.5]
    assert second.advantages == [0.0] * 8 + [-2.0, 0.0, -2.0]


def test_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown sample mode"):
        build_samples("episode", [two_turn()], [[0.0, 0.0]])


def test_collate_right_pads() -> None:
    samples = build_samples("turn", [two_turn()], [[0.5, -2.0]])
    batch = collate(samples, pad_id=0)
    assert batch.input_ids_B_T.shape == (2, 11)
    assert batch.input_ids_B_T[0].tolist() == [10, 11, 12, 20, 21] + [0] * 6
    assert batch.attention_mask_B_T[0].tolist() == [1] * 5 + [0] * 6
    assert batch.loss_mask_B_T.dtype == torch.float32
    assert batch.num_tokens == 4
    assert torch.equal(batch.old_logprobs_B_T, batch.rollout_logprobs_B_T)
    assert batch.advantages_B_T[1, -3:].tolist() == [-2.0, 0.0, -2.0]


def test_micro_batches_fit_the_token_budget() -> None:
    samples = build_samples("turn", [two_turn("g/0"), two_turn("g/1")], [[1.0, 1.0], [1.0, 1.0]])
    groups = micro_batches(samples, max_tokens=22)
    assert [[len(s.input_ids) for s in g] for g in groups] == [[11, 11], [5, 5]]
    assert [len(g) for g in micro_batches(samples, max_tokens=5)] == [1, 1, 1, 1]
    assert sum(len(g) for g in micro_batches(samples, max_tokens=10_000)) == 4


def test_both_modes_give_the_same_loss_and_gradient(tiny_qwen3_dir: Path) -> None:
    model = load_model(str(tiny_qwen3_dir), dtype=torch.float64)
    trajs = [two_turn("g/0", 1.0), two_turn("g/1", 0.0)]
    advantages = [[0.7, 0.7], [-0.7, -0.7]]
    results = []
    for mode in ("trajectory", "turn"):
        batch = collate(build_samples(mode, trajs, advantages), pad_id=0)
        mask = batch.loss_mask_B_T.double()
        logprobs = token_logprobs(model, batch.input_ids_B_T, batch.attention_mask_B_T, mask, chunk_size=4)
        old = logprobs.detach() - 0.05
        inputs = LossInputs(logprobs, old, batch.rollout_logprobs_B_T.double(), batch.advantages_B_T, mask)
        loss = policy_loss("ppo", inputs, LossOptions()).loss
        loss.backward()
        grad = model.get_input_embeddings().weight.grad
        assert isinstance(grad, torch.Tensor)
        results.append((float(loss.detach()), grad.clone()))
        model.zero_grad(set_to_none=True)
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-12, rtol=0)


def test_tokens_from_an_unexpected_weight_version_refuse_their_trajectory() -> None:
    fresh, stale, masked = two_turn("g/0"), two_turn("g/1"), two_turn("g/2")
    fresh.policy_versions = [3, 3, -1, -1, -1, 3, 3, 3]
    stale.policy_versions = [2, 2, -1, -1, -1, 3, 3, 3]  # the first turn came from version 2
    masked.policy_versions = [3, 3, -1, -1, -1, 3, 2, 3]  # version 2 only on a masked token
    assert unexpected_versions([fresh, stale, masked], current=3, max_staleness=0) == [stale]
    assert unexpected_versions([fresh, stale, masked], current=3, max_staleness=1) == []
    assert unexpected_versions([fresh], current=2, max_staleness=0) == [fresh]  # newer than served


def test_infrastructure_failures_leave_the_step_and_every_exclusion_is_counted() -> None:
    from dataclasses import replace

    from turnrl.train.advantages import AdvantageOptions, compute_advantages
    from turnrl.train.exclusions import exclude_failures, exclusion_metrics

    crashed = replace(two_turn("g/2", reward=0.0), stop_reason=StopReason.ENGINE_ERROR, error="engine: down")
    group = [two_turn("g/0", 1.0), two_turn("g/1", 0.0), crashed, failed_start()]
    kept, excluded = exclude_failures(group, keep=False)
    assert kept == group[:2] and excluded == {"engine_error": 1, "env_error": 1}
    # the crashed member weighs on nothing: the group's advantages are those of its two others
    advantages = compute_advantages("grpo", kept, AdvantageOptions())
    assert advantages == compute_advantages("grpo", group[:2], AdvantageOptions())
    samples = build_samples("trajectory", kept, advantages)
    metrics = exclusion_metrics(kept, advantages, samples, excluded)
    assert metrics["train/excluded/engine_error"] == 1 and metrics["train/excluded/env_error"] == 1
    assert metrics["train/zero_advantage_groups"] == 0 and metrics["train/groups"] == 1
    assert exclude_failures(group, keep=True) == (group, {})
    tied = [two_turn("g/0", 1.0), two_turn("g/1", 1.0)]
    tied_advantages = compute_advantages("grpo", tied, AdvantageOptions())
    tied_samples = build_samples("trajectory", tied, tied_advantages)
    tied_metrics = exclusion_metrics(tied, tied_advantages, tied_samples, exclude_failures(tied, False)[1])
    assert (
        tied_metrics["train/zero_advantage_groups"] == 1 and tied_metrics["train/zero_advantage_samples"] == 2
    )


@pytest.mark.parametrize("mode", ["trajectory", "turn"])
def test_last_turn_only_trains_the_last_model_turn_with_the_rest_as_context(mode: str) -> None:
    """``algorithm.loss_turns: last`` (ms-swift's loss_scale last_round): the earlier model turns
    stay in the context, with no loss on them; the last turn keeps its own mask."""
    samples = build_samples(mode, [two_turn()], [[0.5, -2.0]], loss_turns="last")
    trained = [s for s in samples if any(s.loss_mask)]
    (last,) = trained
    assert last.input_ids == [10, 11, 12, 20, 21, 30, 31, 32, 22, 23, 24]
    assert last.loss_mask[-3:] == [1, 0, 1] and sum(last.loss_mask) == 2
    assert last.advantages[-3:] == [-2.0, 0.0, -2.0] and sum(last.advantages[:-3]) == 0
    assert last.rollout_logprobs[:-3] == [0.0] * 8
    with pytest.raises(ValueError, match="unknown loss_turns 'first'"):
        build_samples(mode, [two_turn()], [[0.5, -2.0]], loss_turns="first")


def test_inference_mode_trains_each_turn_on_its_recorded_inference_context() -> None:
    """``algorithm.samples: inference``: a turn with ``context_ids`` (what a chat server would have
    rendered) is trained on that context; a turn without is trained on its exact prefix."""
    traj = two_turn()
    traj.turns[2].context_ids = [10, 11, 12, 21, 30, 31, 32]  # the first turn's "20" rewritten away
    first, second = build_samples("inference", [traj], [[0.5, -2.0]])
    assert first.input_ids == [10, 11, 12, 20, 21] and first.loss_mask == [0, 0, 0, 1, 1]
    assert second.input_ids == [10, 11, 12, 21, 30, 31, 32, 22, 23, 24]
    assert second.loss_mask == [0] * 7 + [1, 0, 1]
    assert second.rollout_logprobs == [0.0] * 7 + [-0.3, 0.0, -0.5]
    assert second.advantages == [0.0] * 7 + [-2.0, 0.0, -2.0]
