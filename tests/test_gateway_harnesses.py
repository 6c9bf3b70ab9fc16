"""Real agent harnesses, unchanged, against the gateway on loopback, each on a toy repository task:
OpenAI's Codex CLI (from npm, headless ``codex exec``, speaking the Responses API with its own
tools) and mini-swe-agent (Python, through litellm's OpenAI client). The task gets done in the
repository, and the session is one exact branch."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gateway_fixtures import assert_exact, gateway_for, serving

from turnrl.engines.scripted import ScriptedEngine
from turnrl.gateway import Reason, read_branches
from turnrl.support.cache import cache_dir

CODEX = cache_dir() / "agents" / "node_modules" / ".bin" / "codex"


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    call = json.dumps({"name": name, "arguments": arguments})
    return f"<think>\nNext step.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"


def one_exact_branch(gateway: Any, calls: int) -> None:
    [session] = gateway.sessions.values()
    assert [(b.reason, b.calls) for b in session.branches] == [(Reason.FIRST, calls)]
    traj = session.branches[0].trajectory(session.name)
    assert_exact(traj, gateway.engine.seen)
    on_disk = read_branches(Path(gateway.config.output_dir) / "calls.jsonl")
    assert [t.input_ids for t in on_disk] == [traj.input_ids]


def test_codex_cli_does_a_task_through_the_gateway(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    assert CODEX.exists(), f"no Codex CLI at {CODEX}: run bash scripts/install_agents.sh"
    repo = tmp_path / "repo"
    repo.mkdir()
    replies = [
        tool_call("exec_command", {"cmd": "printf 'hi\\n' > hello.txt"}),
        "<think>\nWritten.\n</think>\n\nDone: hello.txt holds hi.",
    ]
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, replies), qwen3_tokenizer, tmp_path / "gw")
    with serving(gateway) as url:
        provider = f'{{name="turnrl", base_url="{url}/v1", wire_api="responses", env_key="OPENAI_API_KEY"}}'
        command = [
            str(CODEX), "exec", "--skip-git-repo-check", "-s", "danger-full-access", "-m", "tiny-qwen3",
            "-c", "model_provider=turnrl", "-c", f"model_providers.turnrl={provider}",
            "Create a file hello.txt containing hi",
        ]  # fmt: skip
        env = {**os.environ, "OPENAI_API_KEY": "codex-run", "CODEX_HOME": str(tmp_path / "codex-home")}
        (tmp_path / "codex-home").mkdir()
        done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Done: hello.txt holds hi." in done.stdout
    assert (repo / "hello.txt").read_text() == "hi\n"
    one_exact_branch(gateway, 2)
    messages = gateway.sessions["codex-run"].branches[0].episode.record.messages
    [tool_result] = [m for m in messages if m["role"] == "tool"]
    assert "exited with code 0" in tool_result["content"]


def test_mini_swe_agent_does_a_task_through_the_gateway(
    qwen3_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm's own copy: no download
    import minisweagent
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "test_calc.py").write_text("from calc import add\n\nassert add(2, 3) == 5\n")
    replies = [
        tool_call("bash", {"command": "printf 'def add(a, b):\\n    return a + b\\n' > calc.py"}),
        tool_call("bash", {"command": "python test_calc.py && echo passed"}),
        tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
    ]
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, replies), qwen3_tokenizer, tmp_path / "gw")
    config = yaml.safe_load((Path(minisweagent.__file__).parent / "config" / "mini.yaml").read_text())
    with serving(gateway) as url:
        model = LitellmModel(
            model_name="openai/tiny-qwen3",
            model_kwargs={"api_base": f"{url}/v1", "api_key": "mini-swe"},
            cost_tracking="ignore_errors",
        )
        agent = DefaultAgent(model, LocalEnvironment(cwd=str(repo)), **config["agent"])
        result = agent.run("Make test_calc.py pass.")
    assert result["exit_status"] == "Submitted"
    assert subprocess.run(["python", "test_calc.py"], cwd=repo).returncode == 0
    one_exact_branch(gateway, 3)
    outputs = [
        m["content"]
        for m in gateway.sessions["mini-swe"].branches[0].episode.record.messages
        if m["role"] == "tool"
    ]
    assert "passed" in outputs[1]
