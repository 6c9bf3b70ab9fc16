"""A short CPU run that visibly learns: the tiny Qwen3 learns to answer in capital letters."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from turnrl.app.training import train
from turnrl.env import Env, register_env
from turnrl.train.config import TrainConfig
from turnrl.train.metrics import read_metrics
from turnrl.types import StepResult, Trajectory


class ShoutEnv(Env):
    """One turn; reward: the share of the reply's characters that are capital ASCII letters.

    A random model scores about 0.1 (some of its tokens hold capitals); the reward is dense, so
    every group has a spread and every step has a signal.
    """

    async def step(self, action: str) -> StepResult:
        return StepResult(None, done=True)

    async def score(self, trajectory: Trajectory) -> float:
        text = trajectory.turns[0].text if trajectory.turns else ""
        return sum(c.isascii() and c.isupper() for c in text) / max(len(text), 1)

    @staticmethod
    def dataset(size: int = 16, offset: int = 0) -> list[dict[str, Any]]:
        return [
            {"id": f"shout{offset + i}", "prompt": f"Shout a few words about topic {offset + i}."}
            for i in range(size)
        ]


register_env("test_shout", ShoutEnv, ShoutEnv.dataset)


@pytest.mark.slow
def test_tiny_qwen3_learns_to_shout(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    config = TrainConfig.model_validate(
        {
            "model": str(tiny_qwen3_dir),
            "env": {"name": "test_shout"},
            "data": {"kwargs": {"size": 16}},
            "chat": {"template_kwargs": {"enable_thinking": False}},
            "sampling": {"temperature": 1.0, "max_tokens": 8},
            "limits": {"max_turns": 1, "max_context_tokens": 128},
            "optim": {"lr": 1e-2},
            # One request at a time: batched decoding's rounding depends on which requests share a
            # step (timing), which made this run differ between machines. Alone, it is the same
            # every time. Held-out reward by step 0/4/8/12 with these settings: seed 0
            # 0.125/0.46/1.0/1.0, seed 1 0.125/0.90/1.0/1.0, seed 3 0.125/0.26/0.88/1.0; seed 2
            # stalls (0.125/0.11/0.2/0.2), so learning here is likely, not certain, for a seed.
            "engine": {"max_batch_size": 1},
            "rollout": {"group_size": 16},
            "seed": 0,
            "train": {"steps": 12, "prompts_per_step": 2, "save_every": 0},
            "eval": {"data": {"kwargs": {"size": 8, "offset": 100}}, "every": 0},  # held out, greedy
            "output_dir": str(tmp_path / "run"),
        }
    )
    result = train(config, console=Console(file=io.StringIO()))
    before, after = result["start/eval/reward/mean"], result["eval/reward/mean"]
    assert before < 0.3
    assert after > before + 0.3, f"held-out reward {before:.3f} -> {after:.3f}"
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(13))
    assert (tmp_path / "run" / "rewards.png").is_file()
