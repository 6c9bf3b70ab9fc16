"""Held-out evaluation: pass@k and mean reward per data source with 95% intervals, the same numbers
from `turnrl eval` and from the trainer's periodic evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from turnrl.cli import main
from turnrl.env import register_env
from turnrl.record.codec import trajectory_from_json
from turnrl.testing import ParityEnv
from turnrl.train.evaluation import ALL, eval_metrics, eval_rows, pass_at_k, prompt_rows, wilson
from turnrl.train.metrics import read_metrics
from turnrl.types import StopReason, Trajectory

register_env("test_eval_parity", ParityEnv, ParityEnv.dataset)


def traj(group: str, source: str, reward: float, index: int = 0) -> Trajectory:
    return Trajectory(
        f"{group}/{index}", group, source, StopReason.ENV_DONE, reward=reward, sample_index=index
    )


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 3) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k failures: some pick always passes
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_rows_per_data_source_equal_a_hand_computation() -> None:
    """Two sources: math (prompts a, b; 2 samples each) and code (prompt c). Rewards: a = [1, 0],
    b = [1, 1], c = [0, 0.5]; a trajectory passes at reward >= 1."""
    trajs = [traj("a", "math", 1.0, 0), traj("a", "math", 0.0, 1), traj("b", "math", 1.0, 0)]
    trajs += [traj("b", "math", 1.0, 1), traj("c", "code", 0.0, 0), traj("c", "code", 0.5, 1)]
    code, math_row, every = eval_rows(trajs, ks=(1, 2))
    assert (code.data_source, math_row.data_source, every.data_source) == ("code", "math", ALL)
    assert (math_row.prompts, math_row.trajectories, every.prompts, every.trajectories) == (2, 4, 3, 6)
    # math: per-prompt mean rewards 0.5 and 1.0 -> mean 0.75, s = 0.3536, half = 1.96 * s / sqrt(2)
    half = 1.959963984540054 * math.sqrt(0.125) / math.sqrt(2)
    assert math_row.reward.mean == 0.75
    assert math_row.reward.low == pytest.approx(0.75 - half) and math_row.reward.high == pytest.approx(
        0.75 + half
    )
    assert math_row.pass_at[1].mean == 0.75 and math_row.pass_at[2].mean == 1.0
    # one prompt: a mean, no interval
    assert code.reward.mean == 0.25 and code.reward.low is None and code.pass_at[1].mean == 0.0
    # all: prompts' means 0.5, 1.0, 0.25; pass@1 0.5, 1, 0; pass@2 1, 1, 0
    assert every.reward.mean == pytest.approx(1.75 / 3)
    assert every.pass_at[1].mean == pytest.approx(0.5) and every.pass_at[2].mean == pytest.approx(2 / 3)
    # a rate's interval stays in [0, 1]: all: pass@2 values 1, 1, 0 -> 0.667 ± 1.96 * 0.577 / sqrt(3)
    assert every.pass_at[2].high == 1.0 and every.pass_at[2].low == pytest.approx(2 / 3 - 0.6533, abs=1e-3)
    metrics = eval_metrics([code, math_row, every])
    assert metrics["eval/pass@2"] == pytest.approx(2 / 3) and metrics["eval/math/pass@1"] == 0.75
    assert "eval/code/reward/mean/ci95_low" not in metrics and "eval/reward/mean/ci95_high" in metrics
    # pass@k needs k samples of every prompt: a prompt with one sample leaves pass@2 out
    assert 2 not in eval_rows([*trajs, traj("d", "code", 1.0)], ks=(1, 2))[-1].pass_at


def test_rows_per_prompt_give_pass_at_k_with_an_interval_over_its_attempts() -> None:
    """A task set's numbers task by task: prompt a passes 7 of 10 attempts, prompt b none of 2."""
    assert wilson(10, 7) == pytest.approx((0.3968, 0.8922), abs=1e-4)  # the textbook 7/10 interval
    low, high = wilson(2, 0)
    assert low == 0.0 and high == pytest.approx(0.6576, abs=1e-4)
    trajs = [traj("a", "tasks", 1.0 if i < 7 else 0.0, i) for i in range(10)]
    trajs += [traj("b", "tasks", 0.0, 0), traj("b", "tasks", 0.5, 1)]
    a, b = prompt_rows(trajs, ks=(1, 3))
    assert (a.prompt, a.attempts, a.passes, a.reward) == ("a", 10, 7, 0.7)
    assert a.pass_at[1].mean == 0.7 and (a.pass_at[1].low, a.pass_at[1].high) == wilson(10, 7)
    # pass@3: the unbiased point, 1 - C(3,3)/C(10,3); its interval carried through 1 - (1 - p)^3
    assert a.pass_at[3].mean == pytest.approx(1 - 1 / 120)
    assert a.pass_at[3].low == pytest.approx(1 - (1 - 0.3968) ** 3, abs=1e-3)
    assert (b.attempts, b.passes, b.reward, b.pass_at[1].mean, b.pass_at[1].low) == (2, 0, 0.25, 0.0, 0.0)
    assert 3 not in b.pass_at  # two attempts give no pass@3


def test_eval_command_on_a_checkpoint_gives_the_trainers_numbers(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """`turnrl eval CONFIG --checkpoint DIR` rolls out the held-out set with the checkpoint's weights
    and the trainer's evaluation seeds: greedy, it reproduces the trainer's evaluation at that step."""
    config = {
        "model": str(tiny_qwen3_dir),
        "env": {"name": "test_eval_parity"},
        "sampling": {"temperature": 1.0, "max_tokens": 6},
        "limits": {"max_turns": 1, "max_context_tokens": 128},
        "optim": {"lr": 1e-3},
        "rollout": {"group_size": 4},
        "train": {"steps": 1, "prompts_per_step": 2, "plot": False, "save_every": 1},
        "eval": {"data": {"kwargs": {"size": 6}}, "group_size": 2, "k": [1, 2], "temperature": 0.0},
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    trainer = json.loads((run / "eval" / "step_000001.json").read_text())
    logged = read_metrics(run / "metrics.jsonl")[-1]
    assert logged["eval/pass@1"] == trainer["rows"][-1]["pass_at"]["1"]["mean"]
    checkpoint = str(run / "checkpoints" / "step_000001")
    assert main(["eval", str(path), "--checkpoint", checkpoint, "--per-prompt"]) == 0
    out = run / "checkpoints" / "step_000001" / "eval"
    report = json.loads((out / "eval.json").read_text())
    assert report["rows"] == trainer["rows"] and report["group_size"] == 2
    trajs = [trajectory_from_json(json.loads(line)) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert len(trajs) == 12
    per_prompt = report["prompts_rows"]  # each prompt's own: its 2 attempts, as in the trajectories
    assert sorted(r["prompt"] for r in per_prompt) == sorted({t.group_id for t in trajs})
    for row in per_prompt:
        mine = [t for t in trajs if t.group_id == row["prompt"]]
        assert row["attempts"] == 2 and row["passes"] == sum(t.reward >= 1.0 for t in mine)
    mean = sum(t.reward for t in trajs) / 12  # equal groups: the mean of prompt means
    assert report["rows"][-1]["reward"]["mean"] == pytest.approx(mean)


def test_eval_errors_name_the_problem(
    tmp_path: Path, tiny_qwen3_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"model": str(tiny_qwen3_dir), "env": {"name": "guess_number"}}))
    assert main(["eval", str(path)]) != 0
    assert "set eval.data" in capsys.readouterr().err
    assert main(["eval", str(path), "--set", "eval.k=[4]", "--set", "eval.group_size=2"]) != 0
    assert "eval.group_size is 2" in capsys.readouterr().err
    assert (
        main(["eval", str(path), "--set", "eval.data.limit=2", "--checkpoint", str(tmp_path / "nope")]) != 0
    )
    assert "no checkpoint folder" in capsys.readouterr().err
