"""Crash-safe collection: kill -9 a real rollout part-way, resume, lose and duplicate nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from turnrl.config import load_config
from turnrl.record.codec import trajectory_to_json
from turnrl.rollout.collector import recover
from turnrl.types import StopReason, Trajectory


def config(tmp_path: Path, model: Path, **rollout: Any) -> Path:
    data = {
        "model": str(model),
        "env": {"name": "turnrl.testing:EchoEnv", "kwargs": {"done_after": 2, "delay_s": 0.02}},
        "data": {"kwargs": {"size": 100}},
        "sampling": {"max_tokens": 4},
        "limits": {"max_turns": 2, "max_context_tokens": 256},
        "rollout": {"group_size": 2, "concurrency": 16, **rollout},
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "turnrl.cli", *args]


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_kill_9_then_resume_loses_and_duplicates_nothing(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    cfg = config(tmp_path, tiny_qwen3_dir)
    out = tmp_path / "run" / "trajectories.jsonl"
    proc = subprocess.Popen(cli("rollout", str(cfg)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while len(lines(out)) < 30 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = lines(out)
    assert 30 <= len(before) < 200, "the rollout must be killed part-way"
    with out.open("a") as f:
        f.write('{"id": "cut short by the crash", "resp')  # a write the crash interrupted
    result = subprocess.run(cli("rollout", str(cfg), "--resume"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    after = lines(out)
    assert after[: len(before)] == before  # nothing already on disk was rewritten
    pairs = [(r["group_id"], r["sample_index"]) for r in map(json.loads, after)]
    assert len(pairs) == len(set(pairs)) == 200  # 0 duplicated
    assert set(pairs) == {(f"echo-{i}", k) for i in range(100) for k in range(2)}  # 0 lost
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trajectories"] == 200


def test_resume_refuses_a_different_run(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    cfg = config(tmp_path, tiny_qwen3_dir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "trajectories.jsonl").write_text("")
    saved = load_config(cfg).model_dump()
    saved["sampling"]["max_tokens"] = 5
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    result = subprocess.run(cli("rollout", str(cfg), "--resume"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "config key 'sampling' differs" in result.stderr


def test_recover_drops_a_cut_line_and_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record = Trajectory("a/0", "a", "d", StopReason.ENV_DONE, [1])
    line = json.dumps(trajectory_to_json(record))
    path.write_text(f"{line}\n{line}\n{line[:20]}")
    trajs, dropped = recover(path)
    assert [t.id for t in trajs] == ["a/0"] and dropped == 2
    assert lines(path) == [line]


def test_turns_are_logged_as_they_happen(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    cfg = config(tmp_path, tiny_qwen3_dir, log_turns=True)
    text = cfg.read_text().replace("size: 100", "size: 3")
    cfg.write_text(text)
    result = subprocess.run(cli("rollout", str(cfg)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    trajs = [json.loads(x) for x in lines(tmp_path / "run" / "trajectories.jsonl")]
    turns = [json.loads(x) for x in lines(tmp_path / "run" / "turns.jsonl")]
    assert len(turns) == sum(len(t["turns"]) for t in trajs)
    assert {t["role"] for t in turns} == {"assistant"} and all(t["timings"]["generate"] > 0 for t in turns)
    assert "seconds per turn" in result.stderr and "stop_reasons" in result.stderr
