"""DAPO's batch shaping in a training step: overlong reward shaping and filtering, dynamic sampling."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from turnrl.app.training import build_run
from turnrl.env import Env, register_env
from turnrl.record.codec import trajectory_from_json
from turnrl.train.config import TrainConfig
from turnrl.train.shaping import overlong_penalty, refill_count, shape_overlong, varied_groups
from turnrl.train.trainer import train_step
from turnrl.types import Message, StepResult, StopReason, Trajectory

QUIET = Console(file=io.StringIO())


def traj(group: str, index: int, reward: float, model_tokens: int, stop: StopReason) -> Trajectory:
    return Trajectory(
        f"{group}/{index}",
        group,
        "",
        stop,
        prompt_ids=[1, 2],
        response_ids=[5] * model_tokens,
        loss_mask=[1] * model_tokens,
        rollout_logprobs=[-1.0] * model_tokens,
        reward=reward,
        sample_index=index,
    )


def test_overlong_penalty_is_dapos_soft_punishment() -> None:
    # max 100, buffer 20: free up to 80, then linear to -1 at 100, -1 beyond
    assert [overlong_penalty(n, 100, 20, 1.0) for n in (10, 80, 90, 99, 100, 150)] == [
        0.0,
        0.0,
        -0.5,
        pytest.approx(-0.95),
        -1.0,
        -1.0,
    ]
    assert overlong_penalty(99, 100, 0, 0.5) == 0.0 and overlong_penalty(100, 100, 0, 0.5) == -0.5


def test_shape_overlong_penalizes_and_masks_what_a_length_limit_cut() -> None:
    trajs = [
        traj("a", 0, 1.0, 10, StopReason.ENV_DONE),
        traj("a", 1, 1.0, 90, StopReason.ENV_DONE),
        traj("a", 2, 0.0, 120, StopReason.LENGTH),
    ]
    shaped, metrics = shape_overlong(trajs, 100, 20, 1.0, mask_truncated=True)
    assert [t.reward for t in shaped] == [1.0, 0.5, -1.0]
    assert not any(shaped[2].loss_mask) and all(shaped[1].loss_mask)
    assert metrics == {"overlong/penalized": 2.0, "overlong/penalty_mean": -0.5, "overlong/masked": 1.0}
    assert trajs[1].reward == 1.0  # the rolled-out trajectories are left as they were written


def test_varied_groups_and_refill_counts() -> None:
    trajs = [traj("a", i, 1.0, 3, StopReason.ENV_DONE) for i in range(2)]
    trajs += [traj("b", i, float(i), 3, StopReason.ENV_DONE) for i in range(2)]
    kept, flat = varied_groups(trajs)
    assert [t.group_id for t in kept] == ["b", "b"] and flat == 1
    assert refill_count(3, 1, 2) == 6  # half kept so far: twice the prompts
    assert refill_count(3, 0, 4) == 12  # none kept: at the floor rate of a quarter
    assert refill_count(2, 0, 0) == 2


class HalfFlatEnv(Env):
    """One turn. Prompts named flat-* score 0 every time (nothing to learn); the others score by
    sample index, 0 or 1, so their groups always vary."""

    async def step(self, action: str) -> StepResult:
        return StepResult(None, done=True)

    async def score(self, trajectory: Trajectory) -> float:
        return 0.0 if trajectory.group_id.startswith("flat") else float(trajectory.sample_index % 2)

    @staticmethod
    def dataset() -> list[dict[str, Any]]:
        rows = [{"id": f"flat-{i}", "prompt": f"Say {i}."} for i in range(10)]
        return rows + [{"id": f"vary-{i}", "prompt": f"Tell {i}."} for i in range(6)]


register_env("test_half_flat", HalfFlatEnv, HalfFlatEnv.dataset)


def config(tmp_path: Path, model: Path, algorithm: dict[str, Any]) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "model": str(model),
            "env": {"name": "test_half_flat"},
            "sampling": {"temperature": 1.0, "max_tokens": 6},
            "limits": {"max_turns": 1, "max_context_tokens": 128},
            "rollout": {"group_size": 2},
            "algorithm": algorithm,
            "train": {"steps": 1, "prompts_per_step": 3, "plot": False, "save_rollouts": True},
            "output_dir": str(tmp_path / "run"),
        }
    )


async def one_step(cfg: TrainConfig, out: Path) -> tuple[dict[str, float], list[Trajectory]]:
    """Step 1 of a run of ``cfg``: its metrics and every trajectory it rolled out (``out/run``)."""
    run = build_run(cfg, overwrite=False, resume=False, console=QUIET)
    try:
        metrics = await train_step(run, 1)
    finally:
        await run.engine.close()
    lines = (out / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    return metrics, [trajectory_from_json(json.loads(line)) for line in lines]


async def test_dynamic_sampling_refills_the_step_with_varied_groups(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    cfg = config(tmp_path, tiny_qwen3_dir, {"dynamic_sampling": {"max_rounds": 6}})
    metrics, trajs = await one_step(cfg, tmp_path)
    rolled = {t.group_id for t in trajs}
    flat = {g for g in rolled if g.startswith("flat")}
    assert flat and metrics["dynamic/flat_groups"] == len(flat)  # every flat group rolled was dropped
    assert metrics["dynamic/rounds"] >= 2 and len(rolled) > 3  # refilled with prompts not in the step
    assert metrics["dynamic/kept_groups"] == 3 and metrics["dynamic/short_groups"] == 0
    assert metrics["train/groups"] == 3 and metrics["train/zero_advantage_groups"] == 0
    assert metrics["train/samples"] == 6  # every kept trajectory trains


async def test_without_dynamic_sampling_flat_groups_stay_and_overlong_shapes_rewards(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    algorithm = {"overlong": {"max_tokens": 4, "buffer": 2, "penalty": 0.5, "mask_truncated": True}}
    metrics, _ = await one_step(config(tmp_path, tiny_qwen3_dir, algorithm), tmp_path)
    assert "dynamic/rounds" not in metrics and metrics["train/groups"] == 3
    # a random model runs to max_tokens (6): every trajectory is past 4 tokens, penalized, and cut
    assert metrics["overlong/penalized"] == 6 and metrics["overlong/penalty_mean"] == -0.5
    assert metrics["overlong/masked"] == metrics["stop/length"] * 6


class SlowStartEnv(Env):
    """One turn. Prompts named slow-* take two seconds to reset (a slow sandbox starting), fast-*
    none: the slow groups are the step's slowest. Rewards by sample index, so every group varies."""

    async def reset(self) -> list[Message]:
        if self.sample.id.startswith("slow"):
            await asyncio.sleep(2.0)
        return await super().reset()

    async def step(self, action: str) -> StepResult:
        return StepResult(None, done=True)

    async def score(self, trajectory: Trajectory) -> float:
        return float(trajectory.sample_index % 2)

    @staticmethod
    def dataset() -> list[dict[str, Any]]:
        return [{"id": f"{kind}-{i}", "prompt": f"Say {i}."} for kind in ("fast", "slow") for i in range(3)]


register_env("test_slow_start", SlowStartEnv, SlowStartEnv.dataset)


async def test_oversampling_stops_the_slowest_groups_and_trains_on_complete_ones(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """Three groups a step plus three over-sampled: once three are complete the rest stop. Every
    trajectory rolled out is written once with its stop reason; a stopped group is left out whole."""
    data = config(tmp_path, tiny_qwen3_dir, {}).model_dump()
    data["env"]["name"] = "test_slow_start"
    data["train"]["oversample_groups"] = 3
    metrics, rolled = await one_step(TrainConfig.model_validate(data), tmp_path)
    assert sorted((t.group_id, t.sample_index) for t in rolled) == sorted(
        (row["id"], k) for row in SlowStartEnv.dataset() for k in range(2)
    )  # the step's 3 prompts and 3 more, each trajectory exactly once
    stopped = {t.group_id for t in rolled if t.stop_reason == StopReason.ABORTED}
    assert stopped and all(g.startswith("slow") for g in stopped)  # the slow ones were stopped
    assert metrics["oversample/stopped_groups"] == len(stopped)
    assert metrics["train/groups"] == 6 - len(stopped) >= 3  # every complete group trains, none stopped
    assert metrics["stop/aborted"] > 0


def test_oversampling_is_for_the_synchronous_trainer(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    data = config(tmp_path, tiny_qwen3_dir, {"max_staleness": 1}).model_dump()
    data["train"] |= {"oversample_groups": 2, "overlap": True}
    with pytest.raises(ValueError, match="oversample_groups is for the synchronous trainer"):
        TrainConfig.model_validate(data)
