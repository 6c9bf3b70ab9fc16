"""The training loop on the tiny Qwen3: a step moves the policy and the engine; a resume continues exactly."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from turnrl.app.training import build_run, train
from turnrl.config import ConfigError
from turnrl.env import register_env
from turnrl.testing import ParityEnv
from turnrl.train import trainer
from turnrl.train import update as update_module
from turnrl.train.batch import step_prompts
from turnrl.train.config import LoraSettings, TrainConfig, load_train_config
from turnrl.train.metrics import read_metrics
from turnrl.train.trainer import train_step
from turnrl.types import Sample, SamplingParams

QUIET = Console(file=io.StringIO())


register_env("test_parity", ParityEnv, ParityEnv.dataset)


def config(tmp_path: Path, model: Path, **train: Any) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "model": str(model),
            "env": {"name": "test_parity"},
            "sampling": {"temperature": 1.0, "max_tokens": 6},
            "limits": {"max_turns": 1, "max_context_tokens": 128},
            "optim": {"lr": 1e-3},
            "rollout": {"group_size": 4},
            "train": {"steps": 2, "prompts_per_step": 2, "plot": False, **train},
            "output_dir": str(tmp_path / "run"),
        }
    )


async def test_a_step_changes_the_policy_and_the_engine(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    run = build_run(config(tmp_path, tiny_qwen3_dir), overwrite=False, resume=False, console=QUIET)
    try:
        before = {k: v.clone() for k, v in run.policy.state_dict().items()}
        prompt = run.spec.encoder.conversation().encode_prompt([{"role": "user", "content": "Hello there."}])
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        gen_before = await run.engine.generate(prompt, greedy)
        metrics = await train_step(run, 1)
        gen_after = await run.engine.generate(prompt, greedy)
    finally:
        await run.engine.close()
    after = run.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    engine_weights = run.engine.model.state_dict()
    assert all(torch.equal(engine_weights[k], after[k]) for k in after)  # pushed, not reloaded
    assert run.engine.weight_version == 1
    assert gen_after.logprobs != gen_before.logprobs
    assert metrics["reward/std"] > 0.0 and 0 < metrics["train/samples"] <= 8  # zero-advantage ones skipped
    # the engine sampled with the weights the trainer scored: the rollout ratio is 1 up to rounding
    assert metrics["is/ratio_min"] > 0.99 and metrics["is/ratio_max"] < 1.01
    # the step computed in this process: CPU seconds counted, at most every core busy all along
    assert metrics["time/cpu"] > 0 and 0 < metrics["time/cores_busy"] <= 1.05
    for key in (
        "grad_norm",
        "time/rollout",
        "time/train",
        "tokens/model_mean",
        "truncated/ratio",
        "stop/length",
    ):
        assert key in metrics


async def test_every_steps_update_runs_on_the_runs_one_learner_thread(
    tmp_path: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps' updates run on one thread of the run's own (not asyncio's shared pool, where each
    step could land on another thread and keep another heap arena at its peak), and each update
    hands the heap's free memory back (``turnrl.support.heap``)."""
    threads: list[str] = []
    trims: list[str] = []
    real_update = trainer.update

    def recorded(*args: Any) -> dict[str, float]:
        threads.append(threading.current_thread().name)
        return real_update(*args)

    monkeypatch.setattr(trainer, "update", recorded)
    monkeypatch.setattr(update_module, "trim_heap", lambda: trims.append(threading.current_thread().name))
    run = build_run(config(tmp_path, tiny_qwen3_dir), overwrite=False, resume=False, console=QUIET)
    try:
        for step in (1, 2, 3):
            await train_step(run, step)
            await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.01) for _ in range(8)))  # busy pool
    finally:
        await run.engine.close()
    assert len(threads) >= 2 and set(threads) == {"turnrl-learner_0"}
    assert trims == threads


async def test_bfloat16_precision_trains_float32_weights_with_bfloat16_products(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """``train.precision: bfloat16``: the step trains (float32 weights move), and the old logprobs
    it recomputes under autocast differ from the engine's float32 ones by bfloat16's rounding:
    the rollout ratio is near 1 but no longer 1 to float32 rounding."""
    run = build_run(
        config(tmp_path, tiny_qwen3_dir, precision="bfloat16"), overwrite=False, resume=False, console=QUIET
    )
    try:
        before = {k: v.clone() for k, v in run.policy.state_dict().items()}
        metrics = await train_step(run, 1)
    finally:
        await run.engine.close()
    after = run.policy.state_dict()
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before) and metrics["grad_norm"] > 0
    assert metrics["is/ratio_min"] > 0.8 and metrics["is/ratio_max"] < 1.25
    assert metrics["is/ratio_max"] - metrics["is/ratio_min"] > 1e-3  # bfloat16 did run


@pytest.mark.parametrize(
    "changes", [{"pack": True}, {"share_prefix_tokens": 4}, {"pack": True, "share_prefix_tokens": 4}]
)
async def test_a_packed_or_prefix_sharing_step_equals_a_padded_one(
    changes: dict[str, Any], tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """``train.pack: true`` (samples end to end, no padding), ``train.share_prefix_tokens`` (a
    group's rows run their common prompt once) and both (groups shared where that runs fewer
    tokens, the rest packed) give the same step as plain padded rows from the same seed: the same
    rollouts, loss and gradient norm, and the same update (AdamW divides by the gradients' own
    size, so float rounding shows on near-zero ones: the updates agree to 1% of their norm)."""
    results = []
    for name, settings in (("plain", {}), ("changed", changes)):
        train = {"share_prefix_tokens": 0, "micro_batch_tokens": 64, **settings}
        run = build_run(config(tmp_path / name, tiny_qwen3_dir, **train), False, False, console=QUIET)
        before = {k: v.clone() for k, v in run.policy.state_dict().items()}
        try:
            metrics = await train_step(run, 1)
        finally:
            await run.engine.close()
        update = torch.cat([(v - before[k]).flatten() for k, v in run.policy.state_dict().items()])
        results.append((metrics, update))
    (padded, padded_update), (changed, changed_update) = results
    assert changed["train/tokens"] == padded["train/tokens"] > 0 and padded["train/samples"] >= 2
    assert padded["train/prefix_tokens_shared"] == 0
    assert (changed["train/prefix_tokens_shared"] > 0) == ("share_prefix_tokens" in changes)
    assert changed["loss/value"] == pytest.approx(padded["loss/value"], abs=1e-5)
    assert changed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-4)
    assert float((changed_update - padded_update).norm()) < 0.01 * float(padded_update.norm())


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model" / "model.safetensors"))


def rollout_tokens(path: Path) -> list[tuple[str, list[int]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted((r["id"], r["response_ids"]) for r in rows)


def test_resume_continues_where_the_run_stopped(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    cfg = config(tmp_path, tiny_qwen3_dir, save_every=1, save_rollouts=True)
    out = Path(cfg.output_dir)
    train(cfg, console=QUIET)
    straight = weights(out / "checkpoints" / "step_000002")
    straight_rollouts = rollout_tokens(out / "rollouts" / "step_000002.jsonl")
    shutil.rmtree(out / "checkpoints" / "step_000002")  # as if killed before step 2 was saved
    with pytest.raises(ValueError, match="already holds a training run"):
        train(cfg, console=QUIET)
    train(cfg, resume=True, console=QUIET)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    assert rollout_tokens(out / "rollouts" / "step_000002.jsonl") == straight_rollouts  # the same batch
    resumed = weights(out / "checkpoints" / "step_000002")
    for name, value in straight.items():  # same weights, so the optimizer state came back too
        torch.testing.assert_close(resumed[name], value, atol=1e-5, rtol=1e-4)  # a fresh Adam: ~1e-3 off
    state = torch.load(out / "checkpoints" / "step_000002" / "optimizer.pt", weights_only=False)
    assert {s["step"].item() for s in state["optimizer"]["state"].values()} == {2.0}


def test_checkpoints_without_optimizer_state_are_smaller_and_still_resume(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    full = config(tmp_path / "full", tiny_qwen3_dir, save_every=1)
    train(full, console=QUIET)
    lean = config(tmp_path / "lean", tiny_qwen3_dir, save_every=1, save_optimizer=False, keep_checkpoints=1)
    train(lean, console=QUIET)
    lean_out = Path(lean.output_dir) / "checkpoints"
    assert [p.name for p in lean_out.iterdir()] == ["step_000002"]  # only the newest is kept

    def size(path: Path) -> int:
        return (path / "optimizer.pt").stat().st_size

    assert size(lean_out / "step_000002") * 10 < size(Path(full.output_dir) / "checkpoints" / "step_000002")
    longer = lean.model_copy(update={"train": lean.train.model_copy(update={"steps": 3})})
    train(longer, resume=True, console=QUIET)  # from step 2's model, with fresh AdamW moments
    assert [r["step"] for r in read_metrics(Path(lean.output_dir) / "metrics.jsonl")] == [0, 1, 2, 3]
    state = torch.load(lean_out / "step_000003" / "optimizer.pt", weights_only=False)
    assert state["optimizer"] is None and state["scheduler"]["last_epoch"] == 3


def test_step_prompts_are_a_function_of_seed_and_step() -> None:
    samples = [Sample(f"s{i}", [{"role": "user", "content": "x"}]) for i in range(5)]
    epoch = [step_prompts(samples, 2, k, seed=0) for k in range(2)]
    ids = [s.id for batch in epoch for s in batch]
    assert len(set(ids)) == 4  # no prompt twice in an epoch; the fifth is the epoch's leftover
    assert [s.id for s in step_prompts(samples, 2, 1, seed=0)] == ids[2:]
    firsts = {tuple(s.id for s in step_prompts(samples, 2, 2 * e, seed=0)) for e in range(6)}
    assert len(firsts) > 1  # each epoch is reshuffled
    with pytest.raises(ValueError, match="prompts_per_step"):
        step_prompts(samples, 6, 0, seed=0)


def test_config_is_strict(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny-qwen3\nenv: {name: guess_number}\nalgorithm: {loss: nope}\n")
    with pytest.raises(ConfigError, match="unknown loss 'nope'"):
        load_train_config(path)
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.stepz'"):
        load_train_config(path, ["algorithm.loss=ppo", "train.stepz=3"])
    cfg = load_train_config(path, ["algorithm.loss=cispo", "algorithm.samples=turn"])
    assert cfg.algorithm.loss_options().clip_low == 0.2 and cfg.algorithm.samples == "turn"


def test_warm_start_runs_once_and_is_checkpointed(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    cfg = TrainConfig.model_validate(
        {
            "model": str(tiny_qwen3_dir),
            "env": {"name": "turnrl.env.builtin.key_lookup:KeyLookupEnv"},
            "data": {"kwargs": {"size": 4}},
            "sampling": {"max_tokens": 32},
            "limits": {"max_turns": 2, "max_context_tokens": 1024},
            "rollout": {"group_size": 2},
            "train": {"steps": 1, "prompts_per_step": 2, "plot": False},
            "warm_start": {
                "demos": "turnrl.env.builtin.key_lookup:demonstration",
                "data": {"kwargs": {"size": 4, "seed": 2}},
                "lr": 1e-3,
            },
            "output_dir": str(tmp_path / "run"),
        }
    )
    out = Path(cfg.output_dir)
    train(cfg, console=QUIET)
    assert (out / "checkpoints" / "step_000000" / "model" / "model.safetensors").is_file()
    (start,) = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 0]
    assert start["warm_start/demos"] == 4 and start["warm_start/demo_turns"] == 2
    train(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 2})}),
        resume=True,
        console=QUIET,
    )
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]  # no second warm start


def lora_config(tmp_path: Path, model: Path, **train: Any) -> TrainConfig:
    cfg = config(tmp_path, model, **train)
    return cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"lora": LoraSettings(r=4)})})


async def test_lora_trains_adapters_only_and_serves_merged_weights(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    run = build_run(lora_config(tmp_path, tiny_qwen3_dir), overwrite=False, resume=False, console=QUIET)
    base_before = {
        k: v.clone() for k, v in run.policy.get_base_model().state_dict().items() if "lora_" not in k
    }
    engine_before = {k: v.clone() for k, v in run.engine.model.state_dict().items()}
    try:
        metrics = await train_step(run, 1)
    finally:
        await run.engine.close()
    assert metrics["train/samples"] > 0
    trained = {n for n, p in run.policy.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    base_after = {k: v for k, v in run.policy.get_base_model().state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)  # the base is frozen
    served = run.engine.model.state_dict()
    changed = {k for k in served if not torch.equal(served[k], engine_before[k])}
    assert changed and all(k.endswith("_proj.weight") for k in changed)  # only the adapted layers
    # the engine's weights are exactly base + scale * B @ A: its logits equal the adapted policy's
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(run.engine.model(ids).logits, run.policy(ids).logits, atol=1e-4, rtol=1e-4)
    assert run.engine.weight_version == 1


def test_merged_state_of_a_whole_lora_state_dict_is_the_merged_model(tiny_qwen3_dir: Path) -> None:
    """What an FSDP run with LoRA pushes: the plain model's weights built from the LoRA model's whole
    state dict (as gathered from the shards) equal peft's own merge of every adapted layer."""
    from turnrl.models import load_model
    from turnrl.train.lora import full_weights, merged_state, wrap_lora

    policy = wrap_lora(
        load_model(str(tiny_qwen3_dir)), LoraSettings(r=4, target_modules=["q_proj", "down_proj"])
    )
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    merged, expected = merged_state(policy.state_dict(), policy), full_weights(policy)
    base = load_model(str(tiny_qwen3_dir)).state_dict()
    assert merged.keys() == expected.keys() == base.keys()
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, atol=1e-6, rtol=1e-5)
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed == {name for name in base if name.endswith(("q_proj.weight", "down_proj.weight"))}


def test_lora_checkpoints_hold_adapters_and_resume(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    cfg = lora_config(tmp_path, tiny_qwen3_dir, save_every=1)
    out = Path(cfg.output_dir)
    train(cfg, console=QUIET)
    step2 = out / "checkpoints" / "step_000002" / "model"
    assert (step2 / "adapter_config.json").is_file() and not (step2 / "model.safetensors").exists()
    straight = load_file(str(step2 / "adapter_model.safetensors"))
    shutil.rmtree(out / "checkpoints" / "step_000002")
    train(cfg, resume=True, console=QUIET)
    resumed = load_file(str(step2 / "adapter_model.safetensors"))
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-5, rtol=1e-4)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]


async def test_inference_samples_turn_on_inference_contexts_and_train(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    cfg = config(tmp_path, tiny_qwen3_dir)
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"samples": "inference"})})
    run = build_run(cfg, overwrite=False, resume=False, console=QUIET)
    try:
        assert run.spec.inference_contexts  # the rollout records what the samples train on
        metrics = await train_step(run, 1)
    finally:
        await run.engine.close()
    assert metrics["train/samples"] > 0


def test_a_step_of_cut_turns_is_warned_of_and_the_run_can_be_viewed(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """Every turn cut at max_tokens: the step says so in a warning line and in its metrics; the
    training run's saved rollouts and evaluations open in the viewer."""
    from turnrl.train.metrics import step_warnings
    from turnrl.viewer.page import read_run

    cfg = config(tmp_path, tiny_qwen3_dir, steps=1, save_rollouts=True)
    cfg = cfg.model_copy(update={"sampling": SamplingParams(temperature=1.0, max_tokens=1)})
    said = io.StringIO()
    train(cfg, console=Console(file=said, width=200))
    [record] = [r for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl") if r["step"] == 1]
    assert record["train/turns_cut_fraction"] == 1.0
    assert "warning: step 1: 100% of model turns were cut at max_tokens" in said.getvalue()
    assert step_warnings(3, {"train/samples": 0})[0].startswith("warning: step 3 trained on no samples")
    assert step_warnings(3, {"train/samples": 5, "train/turns_cut_fraction": 0.4}) == []
    viewed = read_run(Path(cfg.output_dir))
    assert {t["info"]["split"] for t in viewed.trajectories} >= {"train"} and viewed.trajectories[0]["info"][
        "step"
    ] == "000001"
