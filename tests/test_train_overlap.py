"""Overlapped training: rollouts go on while the trainer steps, within the staleness bound."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import turnrl.train.overlap as overlap
import turnrl.train.update as update_module
from turnrl.app.training import train
from turnrl.engines.hf.scheduler import Scheduler
from turnrl.env import register_env
from turnrl.record.codec import trajectory_from_json
from turnrl.rollout.collector import collect
from turnrl.testing import ParityEnv
from turnrl.train.config import TrainConfig
from turnrl.train.metrics import read_metrics
from turnrl.types import Trajectory

QUIET = Console(file=io.StringIO())


register_env("test_overlap_coin", ParityEnv, ParityEnv.dataset)


class FlatEnv(ParityEnv):
    """Every trajectory scores 1: every group's rewards are equal."""

    async def score(self, trajectory: Trajectory) -> float:
        return 1.0


register_env("test_overlap_flat", FlatEnv, FlatEnv.dataset)


def count_groups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the groups the overlapped producer starts (in the returned list's one item)."""
    started = [0]

    async def counted(*args: Any, **kwargs: Any) -> list[Trajectory]:
        started[0] += 1
        return await collect(*args, **kwargs)

    monkeypatch.setattr(overlap, "collect", counted)
    return started


def config(tmp_path: Path, model: Path, name: str, **train_keys: Any) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "model": str(model),
            "env": {"name": "test_overlap_coin"},
            "data": {"kwargs": {"size": 16}},
            "sampling": {"temperature": 1.0, "max_tokens": 8},
            "limits": {"max_turns": 1, "max_context_tokens": 128},
            "rollout": {"group_size": 4},
            "algorithm": {"max_staleness": 1},
            "train": {"steps": 4, "prompts_per_step": 2, "plot": False, "save_rollouts": True, **train_keys},
            "output_dir": str(tmp_path / name),
        }
    )


def rollouts(out: Path, step: int) -> list[Trajectory]:
    lines = (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return [trajectory_from_json(json.loads(line)) for line in lines]


def test_a_slow_trainer_never_trains_past_the_staleness_bound(
    tmp_path: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer sleeps a second per update, so the producer runs ahead to its in-flight bound
    and groups wait in the queue across updates: those with a token more than one version old
    are refused at batch time, and no step trains on one."""
    update = update_module.update_policy

    def slow(*args: Any, **kwargs: Any) -> dict[str, float]:
        time.sleep(1.0)
        return update(*args, **kwargs)

    monkeypatch.setattr(update_module, "update_policy", slow)
    started = count_groups(monkeypatch)
    cfg = config(tmp_path, tiny_qwen3_dir, "async", overlap=True, max_inflight_groups=6)
    train(cfg, console=QUIET)
    records = read_metrics(tmp_path / "async" / "metrics.jsonl")[1:]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # every group rolled out was taken by a step (the refused ones too): past the last step the
    # producer rolls out only the refills of dropped groups, nothing the run would throw away
    taken = sum(len(rollouts(tmp_path / "async", step)) for step in range(1, 5)) // 4
    assert started[0] == taken >= 4 * 2
    assert all(r["async/staleness_max"] <= 1 for r in records)
    assert sum(r["train/refused_versions"] for r in records) > 0  # stale groups were met and refused
    assert any(r.get("async/staleness/1", 0) > 0 for r in records)  # tokens a version old were trained
    assert any(r["async/trainer_idle_s"] < 0.5 for r in records[1:])  # groups were ready ahead
    assert all(r["async/rollout_idle_s"] >= 0 for r in records)


def test_versions_per_token_mean_the_same_in_sync_and_overlapped_runs(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """Both runs on one seed: env tokens carry -1, a model token the weight version that sampled it.
    In the synchronous run every model token of step s was sampled by version s - 1; overlapped,
    a step's trajectories hold versions from s - 1 - max_staleness up to s - 1, never decreasing
    along a trajectory (an update between two tokens of a running request moves it forward)."""
    train(config(tmp_path, tiny_qwen3_dir, "sync"), console=QUIET)
    train(config(tmp_path, tiny_qwen3_dir, "async", overlap=True), console=QUIET)
    for step in range(1, 5):
        for traj in rollouts(tmp_path / "sync", step):
            model = {v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m}
            assert model == {step - 1}
            assert all(v == -1 for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if not m)
        for traj in rollouts(tmp_path / "async", step):
            model = [v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m]
            assert model == sorted(model) and max(model) <= step - 1
            assert all(v == -1 for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if not m)
    records = read_metrics(tmp_path / "async" / "metrics.jsonl")[1:]
    assert all(r["async/staleness_max"] <= 1 for r in records)


@pytest.mark.parametrize("env", ["test_overlap_coin", "test_overlap_flat"])
def test_overlapped_dynamic_sampling_skips_flat_groups_within_its_rounds(
    tmp_path: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch, env: str
) -> None:
    """``algorithm.dynamic_sampling`` with overlap: a step skips groups whose rewards are all equal
    (groups of 2 coin flips: half of them) and takes the next ones, up to ``max_rounds`` steps' worth
    of groups; it trains on the varied ones only. When every group is flat the run still ends, each
    step short of all its groups. Past the last step only refills of dropped groups are rolled out."""
    started = count_groups(monkeypatch)
    cfg = config(tmp_path, tiny_qwen3_dir, "dyn", overlap=True).model_dump()
    cfg["env"]["name"] = env
    cfg["rollout"]["group_size"] = 2
    cfg["algorithm"]["dynamic_sampling"] = {"max_rounds": 3}
    train(TrainConfig.model_validate(cfg), console=QUIET)
    records = read_metrics(tmp_path / "dyn" / "metrics.jsonl")[1:]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    taken = 0
    for r in records:
        groups = len(rollouts(tmp_path / "dyn", r["step"])) // 2
        taken += groups
        assert groups == r["dynamic/kept_groups"] + r["dynamic/flat_groups"] <= 2 * 3
        assert r["dynamic/kept_groups"] + r["dynamic/short_groups"] == 2 and r["dynamic/rounds"] <= 3
        assert r["train/groups"] == r["dynamic/kept_groups"]
    flat = sum(r["dynamic/flat_groups"] for r in records)
    if env == "test_overlap_flat":
        assert all(r["dynamic/short_groups"] == 2 and r["dynamic/rounds"] == 3 for r in records)
    else:
        assert flat > 0 and sum(r["dynamic/kept_groups"] for r in records) > 4
    assert taken <= started[0] <= taken + sum(r["dynamic/short_groups"] for r in records)


def test_overlap_needs_a_staleness_bound(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    data = config(tmp_path, tiny_qwen3_dir, "x", overlap=True).model_dump()
    data["algorithm"]["max_staleness"] = 0
    with pytest.raises(ValueError, match="max_staleness to at least 1"):
        TrainConfig.model_validate(data)


def test_masking_offpolicy_tokens_leaves_loss_only_on_each_trajectorys_newest_version(
    tmp_path: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``algorithm.offpolicy_tokens: mask``: a turn an update split keeps its older tokens in the
    sequence (the engine conditioned on them) but without loss; the trajectory's newest carry it.
    Each decode step waits 50 ms, so a step's groups generate (started when the step before took
    its groups) longer than the step before trains: its update meets them in flight."""
    decode = Scheduler._decode

    def slow(self: Scheduler, batch: Any) -> None:
        time.sleep(0.05)
        decode(self, batch)

    monkeypatch.setattr(Scheduler, "_decode", slow)
    cfg = config(tmp_path, tiny_qwen3_dir, "mask", overlap=True, max_inflight_groups=2).model_dump()
    cfg["algorithm"]["offpolicy_tokens"] = "mask"
    cfg["sampling"]["max_tokens"] = 48
    cfg["limits"]["max_context_tokens"] = 256
    train(TrainConfig.model_validate(cfg), console=QUIET)
    masked = 0
    for step in range(1, 5):
        for traj in rollouts(tmp_path / "mask", step):
            sampled = [v for v in traj.policy_versions if v >= 0]  # every model token, masked or not
            trained = {v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m}
            assert trained <= {max(sampled)}
            masked += int(traj.metrics["tokens/offpolicy_masked"])
            assert traj.metrics["tokens/offpolicy_masked"] == sum(v < max(sampled) for v in sampled)
    assert masked > 0  # updates met generations in flight
