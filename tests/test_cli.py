"""The command line as a user runs it: real processes, exit codes, one-line errors, files on disk."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml


def turnrl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnrl.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def write_config(tmp_path: Path, model: str, overrides: dict[str, Any] | None = None) -> Path:
    config: dict[str, Any] = {
        "model": model,
        "env": {"name": "turnrl.testing:EchoEnv", "kwargs": {"done_after": 2}},
        "data": {"kwargs": {"size": 3}},
        "sampling": {"max_tokens": 8},
        "limits": {"max_turns": 3, "max_context_tokens": 512},
        "rollout": {"group_size": 2, "concurrency": 4},
        "output_dir": str(tmp_path / "run"),
    }
    for key, value in (overrides or {}).items():
        config[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_rollout_writes_trajectories_and_summary(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    config = write_config(tmp_path, str(tiny_qwen3_dir))
    result = turnrl("rollout", str(config), "--set", "rollout.group_size=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 6
    first = json.loads(lines[0])
    assert len(first["response_ids"]) == len(first["loss_mask"]) == len(first["rollout_logprobs"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trajectories"] == 6 and sum(summary["stop_reasons"].values()) == 6
    again = turnrl("rollout", str(config), cwd=tmp_path)  # the same command again: a new folder
    assert again.returncode == 0 and "writing to" in again.stderr, again.stderr
    assert (tmp_path / "run-2" / "trajectories.jsonl").read_text().count("\n") == 6
    assert len((tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()) == 6  # kept
    assert "run-2" in (tmp_path / "run-2" / "config.yaml").read_text()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"limits": {"max_turn": 3}}, "unknown config key 'limits.max_turn'"),
        ({"model": "/no/such/model"}, "/no/such/model"),
        ({"env": {"name": "no_such_module:Env"}}, "'no_such_module:Env': no module named 'no_such_module'"),
        ({"data": {"path": "rows.jsonl"}}, "data row 1 of rows.jsonl has no 'prompt'"),
        ({"sampling": {"temperature": -1}}, "config key 'sampling.temperature'"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    (tmp_path / "rows.jsonl").write_text('{"prompt": "hi"}\n{"id": "x", "answer": 3}\n')
    config = write_config(tmp_path, "tiny-qwen3", change)
    result = turnrl("rollout", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_unknown_set_key_and_missing_config(tmp_path: Path) -> None:
    config = write_config(tmp_path, "tiny-qwen3")
    result = turnrl("rollout", str(config), "--set", "rollout.nn=3", cwd=tmp_path)
    assert result.returncode == 2 and "unknown config key 'rollout.nn'" in result.stderr
    result = turnrl("rollout", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert result.returncode == 2 and "config file not found" in result.stderr


def test_check_template(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    result = turnrl("check-template", str(tiny_qwen3_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "SAFE for delta encoding" in result.stdout and "role 'tool': fast path" in result.stdout
    result = turnrl("check-template", str(tmp_path / "nothing-here"), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1


def test_view_writes_a_page_and_rejects_a_missing_run(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    config = write_config(tmp_path, str(tiny_qwen3_dir))
    assert turnrl("rollout", str(config), cwd=tmp_path).returncode == 0
    result = turnrl("view", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "run" / "view.html").read_text()
    assert page.startswith("<!DOCTYPE html>") or page.lstrip().lower().startswith("<!doctype html>")
    assert "echo-0/0" in page  # the trajectories are embedded
    missing = turnrl("view", str(tmp_path / "nope"), cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1


def test_rollout_with_env_workers_on_ray(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    pytest.importorskip("ray")
    config = write_config(tmp_path, str(tiny_qwen3_dir))
    result = turnrl(
        "rollout",
        str(config),
        "--set",
        "env.ray.enabled=true",
        "--set",
        "env.ray.num_workers=1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trajectories"] == 6 and "env_error" not in summary["stop_reasons"]


def test_server_engine_needs_urls(tmp_path: Path) -> None:
    config = write_config(tmp_path, "tiny-qwen3", {"engine": {"kind": "openai", "dialect": "llamacpp"}})
    result = turnrl("rollout", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "missing config key 'engine.urls'" in result.stderr


def train_config(tmp_path: Path, model: Path, *, turns: int, prompts: int, steps: int) -> Path:
    """A `turnrl train` config on the tiny model: EchoEnv episodes of ``turns`` turns, 2 prompts of
    2 samples a step, a checkpoint every step, output in ``tmp_path / "train"``."""
    config = {
        "model": str(model),
        "env": {"name": "turnrl.testing:EchoEnv", "kwargs": {"done_after": turns}},
        "data": {"kwargs": {"size": prompts}},
        "sampling": {"max_tokens": 6},
        "limits": {"max_turns": turns, "max_context_tokens": 256},
        "rollout": {"group_size": 2},
        "train": {"steps": steps, "prompts_per_step": 2, "plot": False, "save_every": 1},
        "output_dir": str(tmp_path / "train"),
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _metric_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(
    ("sig", "ignore_sigint"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGTERM, True)],
    ids=["ctrl-c", "sigterm", "sigterm-background-job"],
)
def test_train_stops_on_a_signal_and_resumes(
    tmp_path: Path, tiny_qwen3_dir: Path, sig: signal.Signals, ignore_sigint: bool
) -> None:
    """Ctrl-C or SIGTERM mid-training stops ``turnrl train`` promptly with exit 130 and the resume
    command; the resume goes on after the last saved step. A script's background job starts with
    SIGINT ignored: SIGTERM must stop it all the same."""
    path = train_config(tmp_path, tiny_qwen3_dir, turns=2, prompts=4, steps=10_000)
    metrics = tmp_path / "train" / "metrics.jsonl"

    def ignore() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def terminal() -> None:  # as in a terminal, however the suite was started (a background job ignores it)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, "-m", "turnrl.cli", "train", str(path)],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        preexec_fn=ignore if ignore_sigint else terminal,
    )
    try:
        deadline = time.monotonic() + 240
        while max(_metric_steps(metrics), default=0) < 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "no training step in 240 s"
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)  # a hang fails here
    finally:
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "--resume" in err
    done = max(_metric_steps(metrics))
    again = turnrl("train", str(path), "--resume", "--set", f"train.steps={done + 1}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    steps = _metric_steps(metrics)
    assert steps[-1] == done + 1 and steps.count(done) == 1


def test_train_runs_a_step_and_resumes(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    path = train_config(tmp_path, tiny_qwen3_dir, turns=1, prompts=2, steps=1)
    result = turnrl("train", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "train" / "metrics.jsonl").exists()
    again = turnrl("train", str(path), "--resume", "--set", "train.steps=2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == 2 and steps.count(1) == 1  # resumed after step 1, did not redo it
    bad = turnrl("train", str(path), "--set", "optim.lrr=1", cwd=tmp_path)
    assert bad.returncode == 2 and "unknown config key 'optim.lrr'" in bad.stderr


def test_set_switches_an_engine_kind_as_a_user_types_it() -> None:
    """``--set engine.kind=hf`` on a scripted config replaces the section (the scripted engine's
    policy means nothing to hf), whatever the order of the command's other overrides."""
    from turnrl.config import HFEngineConfig, load_config

    example = Path(__file__).resolve().parents[1] / "examples" / "scripted_guess_number.yaml"
    assert load_config(example).engine.kind == "scripted"
    switched = load_config(example, ["engine.dtype=float32", "engine.kind=hf", "engine.max_batch_size=3"])
    assert isinstance(switched.engine, HFEngineConfig)
    assert (switched.engine.dtype, switched.engine.max_batch_size) == ("float32", 3)
    assert load_config(example, ["engine.kind=scripted"]).engine.kind == "scripted"  # same kind: kept


def test_validate_checks_a_run_against_the_documented_record(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    config = write_config(tmp_path, str(tiny_qwen3_dir))
    assert turnrl("rollout", str(config), cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    result = turnrl("validate", str(run), cwd=tmp_path)
    assert result.returncode == 0 and "6 trajectories, all valid" in result.stdout + result.stderr
    lines = (run / "trajectories.jsonl").read_text().splitlines()
    broken = json.loads(lines[1])
    broken["loss_mask"].pop()  # one mask entry short: the first violation, on line 2
    (run / "trajectories.jsonl").write_text("\n".join([lines[0], json.dumps(broken), *lines[2:]]) + "\n")
    result = turnrl("validate", str(run), cwd=tmp_path)
    said = result.stdout + result.stderr
    assert result.returncode == 1 and f"trajectories.jsonl:2 (id {broken['id']})" in said
    assert "loss_mask has" in said and said.count("\n") == 1


def test_validate_names_each_kind_of_violation() -> None:
    from turnrl.rollout.validate import Invalid, check_record

    good = {
        "schema_version": 4, "id": "s/0", "group_id": "s", "data_source": "d", "stop_reason": "env_done",
        "prompt_ids": [1, 2], "response_ids": [5, 6, 7], "loss_mask": [1, 1, 0],
        "rollout_logprobs": [-0.1, -0.2, 0.0], "policy_versions": [0, 0, -1],
        "turns": [{"role": "assistant", "start": 0, "end": 2}, {"role": "tool", "start": 2, "end": 3}],
        "messages": [{"role": "user", "content": [{"type": "image", "image_index": 0}]}],
        "images": ["data:image/png;base64,AAAA"], "reward": 1.0, "turn_rewards": [0.0], "num_turns": 1,
        "metrics": {},
    }  # fmt: skip
    check_record(good)
    cases = {
        "schema_version must be the first key": {"id": "x", **good},
        "newer than this turnrl reads": {**good, "schema_version": 99},
        "stop_reason 'won'": {**good, "stop_reason": "won"},
        "rollout_logprobs[2] is -0.3, expected 0.0": {**good, "rollout_logprobs": [-0.1, -0.2, -0.3]},
        "policy_versions has 2 entries": {**good, "policy_versions": [0, 0]},
        "env tokens are never trained": {
            **good,
            "loss_mask": [1, 1, 1],
            "rollout_logprobs": [-0.1, -0.2, -0.3],
        },
        "turns[1] spans [1, 3)": {
            **good,
            "turns": [good["turns"][0], {"role": "tool", "start": 1, "end": 3}],
        },
        "num_turns is 2": {**good, "num_turns": 2},
        "points at image 1": {
            **good,
            "messages": [{"role": "user", "content": [{"type": "image", "image_index": 1}]}],
        },
        "response_ids holds -5": {**good, "response_ids": [5, -5, 7]},
    }
    for said, record in cases.items():
        with pytest.raises(Invalid, match=re.escape(said)):
            check_record(record)
