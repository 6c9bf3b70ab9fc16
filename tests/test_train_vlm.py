"""GRPO on a vision-language model: the training forward pass sees the trajectory's images."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from rich.console import Console

from turnrl.app.training import build_run
from turnrl.env import Env, register_env
from turnrl.models import resolve_model
from turnrl.train.config import TrainConfig
from turnrl.train.trainer import train_step
from turnrl.types import Message, StepResult, Trajectory

QUIET = Console(file=io.StringIO())


def square(shade: int, size: int) -> Image.Image:
    return Image.new("RGB", (size, size), (shade, 255 - shade, 90))


class ShadesEnv(Env):
    """A picture in the prompt and one per observation; reward: the answer's length is even."""

    async def reset(self) -> list[Message]:
        self.turn = 0
        shade = int(self.sample.metadata["shade"])
        text = {"type": "text", "text": "Name the colour."}
        return [{"role": "user", "content": [text, {"type": "image", "image": square(shade, 56)}]}]

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        return StepResult(self.turn, 0.0, self.turn >= 3)

    def format_observation(self, observation: Any) -> list[Message]:
        image = square(40 * int(observation), 28 + 14 * int(observation))
        return [
            {
                "role": "user",
                "content": [{"type": "text", "text": "And now?"}, {"type": "image", "image": image}],
            }
        ]

    async def score(self, trajectory: Trajectory) -> float:
        return float(len(trajectory.turns[-1].text) % 2 == 0)

    @staticmethod
    def dataset(size: int = 4) -> list[dict[str, Any]]:
        return [{"id": f"s{i}", "prompt": "colours", "metadata": {"shade": 60 * i}} for i in range(size)]


register_env("test_shades", ShadesEnv, ShadesEnv.dataset)


@pytest.mark.parametrize("samples", ["trajectory", "turn", "inference"])
async def test_a_grpo_step_on_a_vlm_scores_with_the_images_the_engine_saw(
    tmp_path: Path, samples: str
) -> None:
    """Whole trajectories, or one sample per model turn with the images of its own context."""
    model = resolve_model("tiny-qwen2-vl").path
    cfg = TrainConfig.model_validate(
        {
            "model": model,
            "env": {"name": "test_shades"},
            # a random model rarely ends a turn: every 7th token id ends one here
            "sampling": {"temperature": 1.0, "max_tokens": 24, "stop_token_ids": list(range(0, 151000, 7))},
            "limits": {"max_turns": 3, "max_context_tokens": 1024},
            "optim": {"lr": 1e-3},
            "rollout": {"group_size": 4},
            "algorithm": {"samples": samples},
            "train": {
                "steps": 1,
                "prompts_per_step": 2,
                "plot": False,
                "save_rollouts": True,
            },
            "output_dir": str(tmp_path / "run"),
        }
    )
    run = build_run(cfg, overwrite=False, resume=False, console=QUIET)
    before = {k: v.clone() for k, v in run.policy.state_dict().items()}
    try:
        metrics = await train_step(run, 1)
    finally:
        await run.engine.close()
    assert metrics["turns/mean"] > 1.5 and metrics["train/samples"] > 0
    # the trainer's logprobs, computed over the merged image inputs (per turn: the first k images),
    # equal the rollout's: a ratio of 1. Inference contexts re-tokenize what a random model
    # sampled, so their logprobs may differ from the exact prefix's.
    if samples != "inference":
        assert 0.999 < metrics["is/ratio_min"] <= metrics["is/ratio_max"] < 1.001
    if samples != "trajectory":
        assert metrics["train/samples"] > 2 * 4  # a sample per model turn, not per trajectory
    after = run.policy.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("visual" in k for k in changed) and any("language_model" in k for k in changed)
    assert run.engine.weight_version == 1
