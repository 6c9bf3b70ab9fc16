"""Nothing lost, nothing silent, as a user meets it on the command line: real `turnrl` processes
racing for one folder, runs where everything failed exiting non-zero with one line, mistakes
caught before the first trajectory, an --overwrite that keeps the old run until the new one works."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

ENVS = '''
import asyncio, time
from turnrl import Env, StepResult


class Slow(Env):
    """Two turns, each step a second: a run that lasts a few seconds."""

    async def step(self, action):
        await asyncio.sleep(1.0)
        return StepResult("more", reward=1.0, done=self.sample.metadata.get("turn", 0) >= 1)


class Raises(Env):
    async def step(self, action):
        raise RuntimeError("the env is broken")


class BrokenReset(Env):
    async def reset(self):
        raise RuntimeError("the env is broken")


class NotAnEnv:
    def __init__(self, sample):
        self.sample = sample


def rows(size=4):
    return [{"id": f"r{i}", "prompt": "Say hi."} for i in range(size)]


def broken_rows(size=4):
    raise OSError("the data service is down")
    yield {}


def bad_rows(size=4):
    return [{"id": "r0", "prompt": [{"role": "user"}]}]


def policy(messages, images, sample):
    return "hi"
'''


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when this returns: nothing listens there


def setup(tmp_path: Path, tiny_qwen3_dir: Path, **overrides: Any) -> Path:
    (tmp_path / "safety_envs.py").write_text(ENVS)
    config: dict[str, Any] = {
        "model": str(tiny_qwen3_dir),
        "engine": {"kind": "scripted", "policy": "safety_envs:policy"},
        "env": {"name": "safety_envs:Slow"},
        "data": {"generator": "safety_envs:rows"},
        "sampling": {"max_tokens": 8},
        "limits": {"max_turns": 2, "max_context_tokens": 512, "env_timeout_s": 5},
        "rollout": {"group_size": 2, "concurrency": 8},
        "output_dir": str(tmp_path / "run"),
        **overrides,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(config: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "turnrl.cli", "rollout", str(config), *args],
        cwd=config.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def turnrl(config: Path, *args: str, command: str = "rollout") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnrl.cli", command, str(config), *args],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("gap", [0.0, 3.0])
def test_two_launches_of_one_command_write_two_folders_and_lose_nothing(
    tmp_path: Path, tiny_qwen3_dir: Path, gap: float
) -> None:
    config = setup(tmp_path, tiny_qwen3_dir)
    first = start(config)
    time.sleep(gap)
    second = start(config)
    outs = [p.communicate(timeout=300) for p in (first, second)]
    assert first.returncode == second.returncode == 0, outs
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("run"))
    assert folders == ["run", "run-2"]
    for folder in folders:
        got = records(tmp_path / folder)
        keys = [(r["group_id"], r["sample_index"]) for r in got]
        assert len(keys) == len(set(keys)) == 8  # every trajectory exactly once, in its own folder


def test_resume_or_overwrite_of_a_folder_in_use_refuses_naming_the_writer(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    config = setup(tmp_path, tiny_qwen3_dir, data={"generator": "safety_envs:rows", "kwargs": {"size": 12}})
    first = start(config, "--set", "rollout.concurrency=1")
    out = tmp_path / "run" / "trajectories.jsonl"
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.2)
    for flag in ("--resume", "--overwrite"):
        busy = turnrl(config, flag)
        assert busy.returncode == 2, busy.stderr
        assert f"PID {first.pid}" in busy.stderr and busy.stderr.strip().count("\n") == 0, busy.stderr
    first.communicate(timeout=300)
    assert first.returncode == 0 and len(records(tmp_path / "run")) == 24


def test_resume_of_a_missing_folder_refuses(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    result = turnrl(setup(tmp_path, tiny_qwen3_dir), "--resume")
    assert result.returncode == 2 and "cannot resume" in result.stderr and "does not exist" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "reason", "message"),
    [
        ({"env": {"name": "safety_envs:Raises"}}, "env_error", "the env is broken"),
        ({"env": {"name": "turnrl.testing:BrokenResetEnv"}}, "env_error", "reset is broken"),
        (
            {
                "engine": {
                    "kind": "openai",
                    "urls": ["http://127.0.0.1:PORT"],
                    "max_retries": 0,
                    "timeout_s": 5,
                }
            },
            "engine_error",
            "engine:",
        ),
    ],
    ids=["raising-step", "raising-reset", "dead-server"],
)
def test_a_rollout_where_everything_failed_exits_1_with_one_line_and_keeps_what_it_wrote(
    tmp_path: Path, tiny_qwen3_dir: Path, overrides: dict[str, Any], reason: str, message: str
) -> None:
    text = json.dumps(overrides).replace("PORT", str(closed_port()))
    config = setup(tmp_path, tiny_qwen3_dir, **json.loads(text))
    result = turnrl(config)
    assert result.returncode == 1, result.stderr
    line = next(x for x in result.stderr.splitlines() if x.startswith("turnrl: error:"))
    assert f"most: {reason} x8" in line and message in line and "8 of 8 trajectories" in line
    assert "reward" not in result.stdout  # no summary printed for it
    assert len(records(tmp_path / "run")) == 8  # what was written is kept
    assert "--resume" in result.stderr


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_good_trajectory(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    config = setup(tmp_path, tiny_qwen3_dir)
    assert turnrl(config).returncode == 0
    good = (tmp_path / "run" / "trajectories.jsonl").read_text()
    broken = turnrl(config, "--overwrite", "--set", "env.name=safety_envs:Raises")
    assert broken.returncode == 1, broken.stderr
    assert (tmp_path / "run" / "trajectories.jsonl").read_text() == good  # put back
    assert len(records(tmp_path / "run" / "failed")) == 8 and "put back" in broken.stderr
    assert not (tmp_path / "run" / ".replaced").exists()
    again = turnrl(config, "--overwrite")
    assert again.returncode == 0 and not (tmp_path / "run" / ".replaced").exists()
    assert len(records(tmp_path / "run")) == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"env": {"name": "safety_envs:NotAnEnv"}}, "made a NotAnEnv, not a turnrl Env"),
        ({"data": {"generator": "safety_envs:broken_rows"}}, "data.generator safety_envs:broken_rows failed"),
        ({"data": {"generator": "safety_envs:bad_rows"}}, "prompt message 0 has no 'content'"),
        ({"sampling": {"max_tokens": 0}}, "max_tokens is 0"),
        ({"model": "SILENT_TEMPLATE"}, "the chat template cannot render the first prompt"),
        ({"env": {"name": "math_tools", "kwargs": {"parser": "hermez"}}}, "unknown tool parser 'hermez'"),
    ],
    ids=["not-an-env", "generator-raises", "no-content", "max-tokens-0", "template", "parser-typo"],
)
def test_mistakes_are_caught_before_the_first_trajectory(
    tmp_path: Path, tiny_qwen3_dir: Path, overrides: dict[str, Any], message: str
) -> None:
    if overrides.get("model") == "SILENT_TEMPLATE":  # a model whose chat template renders nothing
        silent = tmp_path / "models" / "silent"
        shutil.copytree(tiny_qwen3_dir, silent)
        tokenizer_config = json.loads((silent / "tokenizer_config.json").read_text())
        tokenizer_config["chat_template"] = "{% for m in messages %}{% endfor %}"
        (silent / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        overrides = {"model": str(silent)}
    result = turnrl(setup(tmp_path, tiny_qwen3_dir, **overrides))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert not (tmp_path / "run").exists()


def test_train_and_eval_where_everything_failed_exit_1_and_print_no_reward(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    (tmp_path / "safety_envs.py").write_text(ENVS)
    train = {
        "model": str(tiny_qwen3_dir),
        "env": {"name": "safety_envs:BrokenReset"},
        "data": {"generator": "safety_envs:rows"},
        "sampling": {"max_tokens": 6},
        "limits": {"max_turns": 2, "max_context_tokens": 256, "max_env_retries_per_turn": 0},
        "rollout": {"group_size": 2},
        "train": {"steps": 2, "prompts_per_step": 2, "plot": False},
        "output_dir": str(tmp_path / "train"),
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(train))
    result = turnrl(path, command="train")
    assert result.returncode == 1, result.stderr
    assert (
        "training step 1 failed: 4 of 4 trajectories" in result.stderr
        and "the env is broken" in result.stderr
    )
    assert "held-out reward" not in result.stderr
    dead = {"kind": "openai", "urls": [f"http://127.0.0.1:{closed_port()}"], "max_retries": 0}
    evaluation = {**train, "env": {"name": "safety_envs:Slow"}, "engine": dead}
    evaluation["eval"] = {"data": {"generator": "safety_envs:rows"}, "group_size": 2}
    path.write_text(yaml.safe_dump(evaluation))
    result = turnrl(path, "--out", str(tmp_path / "eval"), command="eval")
    assert result.returncode == 1, result.stderr
    assert "the evaluation failed: 8 of 8" in result.stderr and "engine_error" in result.stderr
    assert "0.000" not in result.stderr and (tmp_path / "eval" / "eval.jsonl").read_text().count("\n") == 8


def test_messages_name_the_file_at_fault(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    empty = tmp_path / "models" / "empty"
    empty.mkdir(parents=True)
    cut = tmp_path / "models" / "cut"
    shutil.copytree(tiny_qwen3_dir, cut)
    (cut / "tokenizer.json").write_text((cut / "tokenizer.json").read_text()[:5000])
    weights = tmp_path / "models" / "weights"
    shutil.copytree(tiny_qwen3_dir, weights)
    (weights / "model.safetensors").write_bytes((weights / "model.safetensors").read_bytes()[:5000])
    binary = tmp_path / "rows.jsonl"
    binary.write_bytes(bytes(range(256)) * 8)
    hf = {"engine": {"kind": "hf"}}
    cases = [
        ({"model": str(empty)}, f"{empty} has none of tokenizer.json"),
        ({"model": str(cut)}, f"{cut / 'tokenizer.json'} is not valid JSON"),
        ({"model": str(weights), **hf}, f"cannot load its weights from {weights}"),
        ({"data": {"path": str(binary)}}, f"data file {binary} is not UTF-8 text"),
    ]
    for overrides, message in cases:
        result = turnrl(setup(tmp_path, tiny_qwen3_dir, **overrides))
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert result.stderr.strip().count("\n") == 0, result.stderr
    serve_help = subprocess.run(
        [sys.executable, "-m", "turnrl.cli", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert serve_help.returncode == 0 and "usage: turnrl serve" in serve_help.stdout


def test_a_sandbox_without_bubblewrap_is_refused_before_the_first_trajectory(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "turnrl.tools.sandbox.CodeInterpreter"}]}))
    config = setup(tmp_path, tiny_qwen3_dir, env={"name": "tool_env", "kwargs": {"tools_config": str(tools)}})
    bare = tmp_path / "bin"  # a PATH without bwrap
    bare.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "turnrl.cli", "rollout", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PATH": str(bare)},
    )
    assert result.returncode == 2, result.stderr
    assert "needs bubblewrap" in result.stderr and "scripts/install_sandbox.sh" in result.stderr
    assert result.stderr.strip().count("\n") == 0 and not (tmp_path / "run").exists()
