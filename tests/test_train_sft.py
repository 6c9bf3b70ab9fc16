"""The key-lookup task and the supervised warm-start: demonstrations replayed through the real env."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

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


def frozen_below(model: torch.nn.Module, cut: int) -> None:
    for name, param in model.named_parameters():
        layer = name.split("layers.")[1].split(".")[0] if "layers." in name else None
        param.requires_grad_(layer is not None and int(layer) >= cut)


async def key_lookup_demos(model_dir: Path, size: int) -> list[Any]:
    samples = to_samples(KeyLookupEnv.dataset(size=size), "test")
    return await demonstrations(samples, demonstration, spec(load_tokenizer(str(model_dir))))


async def test_a_frozen_trunk_runs_once_and_trains_the_same(tiny_qwen3_dir: Path) -> None:
    """The demo model's forward: the frozen layers' output is kept from the first epoch, and the
    next epochs give the same logprobs and the same updates as the whole model run again."""
    from turnrl.app.demo_model import FrozenTrunk

    trajs = await key_lookup_demos(tiny_qwen3_dir, 6)
    runs = []
    for trunk in (None, 2):
        torch.manual_seed(0)
        model = load_model(str(tiny_qwen3_dir))
        frozen_below(model, 2)
        forward = FrozenTrunk(model, trunk) if trunk is not None else None
        losses = sft_epochs(
            model, trajs, epochs=3, batch_size=4, lr=3e-3, micro_batch_tokens=4096, chunk_size=256,
            seed=0, forward=forward,
        )  # fmt: skip
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}, forward))
    (plain, plain_weights, _), (kept, kept_weights, trunk_forward) = runs
    assert isinstance(trunk_forward, FrozenTrunk) and len(trunk_forward.kept) == len(trajs)
    assert plain[-1] < plain[0] and kept == pytest.approx(plain, rel=1e-4)
    for name, value in plain_weights.items():
        assert torch.allclose(kept_weights[name], value, atol=1e-5), name


async def test_sft_resumes_where_it_was_interrupted(tiny_qwen3_dir: Path) -> None:
    """An interrupted run continued from its last checkpoint (weights, optimizer, losses) ends with
    the same losses and weights as one that never stopped."""
    from turnrl.train.sft import SftState

    trajs = await key_lookup_demos(tiny_qwen3_dir, 6)
    options: dict[str, Any] = dict(
        epochs=2, batch_size=2, lr=3e-3, micro_batch_tokens=4096, chunk_size=256, seed=0
    )

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        model = load_model(str(tiny_qwen3_dir))
        frozen_below(model, 2)
        return model

    whole = fresh()
    losses = sft_epochs(whole, trajs, **options)
    saved: list[tuple[SftState, dict[str, torch.Tensor]]] = []

    def checkpoint(state: SftState) -> None:
        saved.append((copy.deepcopy(state), {n: p.detach().clone() for n, p in cut.named_parameters()}))
        if len(state.losses) == 4:
            raise KeyboardInterrupt

    cut = fresh()
    with pytest.raises(KeyboardInterrupt):
        sft_epochs(cut, trajs, **options, checkpoint=checkpoint)
    state, weights = saved[-1]
    resumed = fresh()
    with torch.no_grad():
        for name, param in resumed.named_parameters():
            param.copy_(weights[name])
    assert sft_epochs(resumed, trajs, **options, resume=state) == pytest.approx(losses, rel=1e-5)
    for (name, param), other in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert torch.allclose(param, other, atol=1e-6), name
