"""Partial rollout on the real embedded engine: pause mid-turn, update weights, resume exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.hf import HFEngine
from turnrl.models import load_model
from turnrl.rollout.collector import collect
from turnrl.rollout.control import RolloutControl
from turnrl.rollout.spec import RolloutSpec
from turnrl.testing import EchoEnv, until
from turnrl.types import Limits, Sample, SamplingParams, StopReason, Trajectory

MAX_TOKENS = 64


def samples(count: int) -> list[Sample]:
    return [Sample(f"p{i}", [{"role": "user", "content": f"Story {i}:"}]) for i in range(count)]


def spec(engine: HFEngine, tokenizer: Any, control: RolloutControl, **kw: Any) -> RolloutSpec:
    return RolloutSpec(
        env_factory=lambda s: EchoEnv(s, done_after=1, delay_s=0.01 * int(s.id[1:])),
        engine=engine,
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=MAX_TOKENS, seed=3),
        limits=Limits(max_turns=2, max_context_tokens=512),
        control=control,
        **kw,
    )


def logprobs_under(model: Any, traj: Trajectory) -> torch.Tensor:
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0][len(traj.prompt_ids) - 1 :]


def perturbed(model: Any) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


async def pause_update_resume(engine: HFEngine, control: RolloutControl, new_weights: dict[str, Any]) -> None:
    # every trajectory is part-way through its turn: six rows decode together, ~5 tokens each
    await until(lambda: engine.tokens_sampled >= 30, what="30 sampled tokens")
    await control.pause(engine)
    version = await engine.update_weights(new_weights)
    control.resume(version)


async def test_pause_update_resume_keeps_tokens_and_conditions_on_them(
    tiny_qwen3_dir: Any, qwen3_tokenizer: Any
) -> None:
    old_model, new_model = load_model(str(tiny_qwen3_dir)), load_model(str(tiny_qwen3_dir))
    new_model.load_state_dict(perturbed(old_model))
    engine = HFEngine(load_model(str(tiny_qwen3_dir)), qwen3_tokenizer, max_batch_size=8, eos_token_ids=[])
    control = RolloutControl()
    run = asyncio.create_task(
        collect(samples(6), spec(engine, qwen3_tokenizer, control), group_size=1, concurrency=6)
    )
    await pause_update_resume(engine, control, new_model.state_dict())
    trajs = await run
    await engine.close()
    assert control.pauses == 1 and all(t.stop_reason == StopReason.LENGTH for t in trajs)
    mixed = [t for t in trajs if {0, 1} <= set(t.policy_versions)]
    assert mixed, "some turn must span the pause"
    for traj in trajs:
        model_turn = traj.turns[0]
        assert model_turn.end - model_turn.start == MAX_TOKENS  # the turn went on where it stopped
        assert len(traj.policy_versions) == len(traj.response_ids)
        old_lp, new_lp = logprobs_under(old_model, traj), logprobs_under(new_model, traj)
        for i, (lp, version) in enumerate(zip(traj.rollout_logprobs, traj.policy_versions, strict=True)):
            expected = old_lp[i] if version == 0 else new_lp[i]
            assert abs(float(expected) - lp) < 2e-3  # each token scored by the weights that sampled it


async def test_mask_offpolicy_masks_older_tokens(tiny_qwen3_dir: Any, qwen3_tokenizer: Any) -> None:
    model = load_model(str(tiny_qwen3_dir))
    engine = HFEngine(model, qwen3_tokenizer, max_batch_size=8, eos_token_ids=[])
    control = RolloutControl()
    rollout = spec(engine, qwen3_tokenizer, control, mask_offpolicy=True)
    run = asyncio.create_task(collect(samples(6), rollout, group_size=1, concurrency=6))
    await pause_update_resume(engine, control, perturbed(model))
    trajs = await run
    await engine.close()
    for traj in trajs:
        newest = max(traj.policy_versions)
        for m, v in zip(traj.loss_mask, traj.policy_versions, strict=True):
            assert not (m and v < newest)
        old = sum(1 for v in traj.policy_versions if 0 <= v < newest)
        assert traj.metrics["tokens/offpolicy_masked"] == old
    assert any(t.metrics["tokens/offpolicy_masked"] > 0 for t in trajs)


class SlowStartEnv(EchoEnv):
    """Sample i takes 0.4 * i seconds to start: the later groups are the slow tail."""

    async def reset(self) -> list[dict[str, Any]]:
        await asyncio.sleep(0.4 * int(self.sample.id[1:]))
        return list(self.sample.prompt)


async def test_over_sampling_stops_the_slowest_groups(tiny_qwen3_dir: Any, qwen3_tokenizer: Any) -> None:
    engine = HFEngine(load_model(str(tiny_qwen3_dir)), qwen3_tokenizer, max_batch_size=16)
    control = RolloutControl()
    rollout = spec(engine, qwen3_tokenizer, control)
    rollout.env_factory = SlowStartEnv
    trajs = await collect(samples(6), rollout, group_size=2, concurrency=12, target_groups=2)
    await engine.close()
    assert len(trajs) == 12  # every trajectory comes back, the stopped ones with their reason
    aborted = {t.group_id for t in trajs if t.stop_reason == StopReason.ABORTED}
    finished = {t.group_id for t in trajs} - aborted
    assert len(finished) >= 2 and aborted and "p5" in aborted
