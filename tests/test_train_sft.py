"""The key-lookup task and the supervised warm-start: demonstrations replayed through the real env."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from turnrl.chat.encoder import ChatEncoder
from turnrl.data import to_samples
from turnrl.env.builtin.key_lookup import KeyLookupEnv, answer_of, demonstration
from turnrl.models import load_model, load_tokenizer
from turnrl.rollout.spec import RolloutSpec
from turnrl.train.sft import demonstrations, sft_epochs
from turnrl.types import Limits, SamplingParams, StopReason


def spec(tokenizer: object) -> RolloutSpec:
    """A rollout spec for KeyLookupEnv; its engine is replaced per demonstration."""
    return RolloutSpec(
        env_factory=KeyLookupEnv,
        engine=None,  # type: ignore[arg-type]
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=64),
        limits=Limits(max_turns=3, max_context_tokens=512),
    )


def test_dataset_rows_hide_the_code() -> None:
    rows = KeyLookupEnv.dataset(size=3, keys=4, seed=5)
    assert rows == KeyLookupEnv.dataset(size=3, keys=4, seed=5)
    for row in rows:
        assert len(row["table"]) == 4 and row["key"] in row["table"]
        assert row["table"][row["key"]] not in str(row["prompt"])
    assert answer_of("x <answer> 12 </answer> <answer>4821</answer>") == "4821"
    assert answer_of("<think><answer>1</answer></think> none") is None


async def test_demonstrations_take_two_turns_and_are_rewarded(qwen3_tokenizer: object) -> None:
    samples = to_samples(KeyLookupEnv.dataset(size=4), "test")
    trajs = await demonstrations(samples, demonstration, spec(qwen3_tokenizer))
    assert len(trajs) == 4
    for traj in trajs:
        assert traj.reward == 1.0 and traj.num_turns == 2
        assert traj.stop_reason == StopReason.NO_TOOL_CALL  # the answer turn has no call
        assert traj.info["num_tool_calls"] == 1 and traj.info["num_tool_errors"] == 0
        assert traj.metrics["check/ok"]
    wrong = await demonstrations(samples[:1], lambda s: ["<answer>0</answer>"], spec(qwen3_tokenizer))
    assert wrong == []  # the env did not reward it: not a demonstration


async def test_warm_start_lowers_the_demonstration_loss(tiny_qwen3_dir: Path) -> None:
    model = load_model(str(tiny_qwen3_dir))
    samples = to_samples(KeyLookupEnv.dataset(size=4), "test")
    trajs = await demonstrations(samples, demonstration, spec(load_tokenizer(str(tiny_qwen3_dir))))
    before = {n: p.clone() for n, p in model.named_parameters()}
    losses = sft_epochs(
        model, trajs, epochs=3, batch_size=4, lr=3e-3, micro_batch_tokens=4096, chunk_size=256, seed=0
    )
    assert len(losses) == 3
    assert losses[-1] < losses[0] * 0.8
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_every_demonstration_is_the_tool_call_then_the_code() -> None:
    (row,) = to_samples(KeyLookupEnv.dataset(size=1, seed=3), "test")
    call, answer = demonstration(row)
    assert f'"key": "{row.metadata["key"]}"' in call
    assert answer == f"<answer>{row.metadata['table'][row.metadata['key']]}</answer>"


@pytest.mark.parametrize("key", ["apple", " 'apple' ", "APPLE"])
async def test_lookup_tool_is_forgiving_about_quotes_and_case(key: str) -> None:
    from turnrl.env.builtin.key_lookup import lookup_tool

    tool = lookup_tool({"apple": "1234"})
    out = await tool.execute("i", {"key": key})
    assert "1234" in str(out)
