"""Training metrics: numbers from trajectories, the console line, metrics.jsonl, trackers, the plot."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
from parts import missing
from rich.console import Console

import turnrl.train
from turnrl.train.metrics import MetricsLog, make_tracker, plot_rewards, read_metrics, rollout_metrics
from turnrl.types import StopReason, Trajectory, Turn


def traj(reward: float, stop: StopReason, mask: list[int], tools: int = 0) -> Trajectory:
    return Trajectory(
        id="g/0",
        group_id="g",
        data_source="t",
        prompt_ids=[1],
        response_ids=[2] * len(mask),
        loss_mask=mask,
        rollout_logprobs=[0.0] * len(mask),
        turns=[Turn("assistant", 0, len(mask), "x")],
        messages=[],
        reward=reward,
        stop_reason=stop,
        num_turns=2,
        metrics={"env_retries": 1, "time/generate": 0.5, "time/env": 0.25},
        info={"num_tool_calls": tools, "num_tool_errors": 1 if tools else 0},
    )


def test_rollout_metrics() -> None:
    trajs = [traj(1.0, StopReason.ENV_DONE, [1, 1, 0, 1], tools=2), traj(0.0, StopReason.LENGTH, [1, 0])]
    m = rollout_metrics(trajs, "eval/")
    assert m["eval/reward/mean"] == 0.5 and m["eval/reward/std"] == 0.5
    assert m["eval/tokens/model_mean"] == 2.0  # mask-1 tokens only: 3 and 1
    assert m["eval/truncated/ratio"] == 0.5
    assert m["eval/stop/env_done"] == 0.5 and m["eval/stop/length"] == 0.5
    assert m["eval/tools/calls"] == 2 and m["eval/tools/errors"] == 1 and m["eval/env/retries"] == 2
    assert m["eval/time/generate_sum"] == 1.0 and m["eval/turns/mean"] == 2.0
    assert rollout_metrics([]) == {}


def test_metrics_log_writes_jsonl_and_a_line_and_trims_on_resume(tmp_path: Path) -> None:
    out = io.StringIO()
    log = MetricsLog(tmp_path, Console(file=out, width=300), None)
    for step in range(3):
        log.log(step, 2, {"reward/mean": 0.25 * step, "eval/reward/mean": 0.5})
    assert "step 2/2 reward 0.500" in out.getvalue() and "eval 0.500" in out.getvalue()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    resumed = MetricsLog(tmp_path, Console(file=io.StringIO()), None, resume_step=1)
    assert [r["step"] for r in resumed.records] == [0, 1]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_trackers_are_optional(tmp_path: Path) -> None:
    assert make_tracker("none", tmp_path, {}) is None
    for name in ("tensorboard", "wandb", "trackio", "mlflow"):
        if importlib.util.find_spec(name) is None:
            with pytest.raises(ImportError, match=f"pip install {name}"):
                make_tracker(name, tmp_path, {})


def test_reward_plot(tmp_path: Path) -> None:
    records = [{"step": s, "reward/mean": s / 4, "eval/reward/mean": s / 5} for s in range(4)]
    note = plot_rewards(records, tmp_path / "rewards.png")
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in note
    else:
        assert (tmp_path / "rewards.png").read_bytes()[:4] == b"\x89PNG"


def test_public_api() -> None:
    for name in turnrl.train.__all__:
        assert getattr(turnrl.train, name) is not None
    assert {"grpo", "rloo", "reward_to_go"} <= set(turnrl.train.ESTIMATORS)


def test_tensorboard_tracker_writes_events(tmp_path: Path) -> None:
    if importlib.util.find_spec("tensorboard") is None:  # the dev extra installs it
        missing("tensorboard is not installed")
    tracker = make_tracker("tensorboard", tmp_path, {"model": "x"})
    assert tracker is not None
    tracker.log({"reward/mean": 0.5}, 1)
    tracker.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
