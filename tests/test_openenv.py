"""OpenEnv envs through their real servers (openenv-core's own app, run by uvicorn in a process):
a classic text-action game and an MCP tool env, with exact tokens (strict check on the Qwen3
template); a full server makes episodes wait, not fail; an unreachable, failing or dying server is
a per-trajectory ``env_error`` with the reason."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from turnrl import ChatEncoder, Limits, RolloutSpec, Sample, SamplingParams, collect
from turnrl.app.parts import build_env_factory
from turnrl.config import EnvConfig
from turnrl.engines.process import free_port
from turnrl.engines.scripted import ScriptedEngine, policy_replies
from turnrl.env.adapters import openenv_env
from turnrl.env.adapters.openenv_env import OpenEnvEnv
from turnrl.types import Message, StopReason

pytest.importorskip("openenv")  # the envs extra, installed by the test command: never skipped in CI

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from openenv_helpers import serve, stop  # noqa: E402
from players import bisect, vault_opener  # noqa: E402  (the shipped scripted players)


@pytest.fixture(scope="module")
def guess_url() -> Iterator[str]:
    proc, url = serve("guess", max_sessions=3)  # fewer sessions than episodes: they must wait their turn
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def vault_url() -> Iterator[str]:
    proc, url = serve("vault")
    yield url
    stop(proc)


def spec(tokenizer: Any, env: dict[str, Any], replies: Any, max_turns: int = 6) -> RolloutSpec:
    return RolloutSpec(
        env_factory=build_env_factory(EnvConfig(name="openenv", kwargs=env)),
        engine=ScriptedEngine(tokenizer, replies),
        encoder=ChatEncoder(tokenizer, {"enable_thinking": False}),
        sampling=SamplingParams(max_tokens=96),
        limits=Limits(max_turns=max_turns),
    )


def samples(size: int, **row: Any) -> list[Sample]:
    rows = OpenEnvEnv.dataset(size=size, system_prompt="Guess the number: answer like [10].")
    return [Sample(r["id"], r["prompt"], metadata={**r, **row}) for r in rows]


async def test_a_classic_openenv_game_is_played_through_its_server(
    guess_url: str, qwen3_tokenizer: Any
) -> None:
    trajs = await collect(samples(8), spec(qwen3_tokenizer, {"url": guess_url}, policy_replies(bisect)))
    assert len(trajs) == 8  # 8 episodes on a server of 3 sessions: they waited for free ones
    for traj in trajs:
        secret = 1 + int(traj.group_id.rsplit("/", 1)[1]) % 20  # the game's number for the row's seed
        assert traj.stop_reason is StopReason.ENV_DONE and traj.reward == 1.0
        assert traj.messages[1] == {"role": "user", "content": "I picked a number from 1 to 20. Guess it."}
        assert (
            traj.messages[-1]["content"] == f"[{secret}]"
        )  # the winning guess (the last observation dropped)
        first = next(t for t in traj.turns if t.role == "assistant")
        assert first.info["openenv_observation"] == {"guesses": 1}  # the observation's other fields
        assert traj.info["openenv/step_count"] == traj.num_turns and traj.info["openenv/style"] == "action"
        assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0
    assert max(t.num_turns for t in trajs) >= 4


async def test_an_action_the_server_rejects_is_said_to_the_model(
    guess_url: str, qwen3_tokenizer: Any
) -> None:
    env = {"url": guess_url, "action_field": "guess"}  # the game's action has no field "guess"
    (traj,) = await collect(samples(1), spec(qwen3_tokenizer, env, ["[10]", "[5]"], max_turns=2))
    assert traj.stop_reason is StopReason.MAX_TURNS and traj.num_turns == 2
    said = traj.messages[3]["content"]
    assert said == "Invalid action: Invalid message: message: Field required"
    first = next(t for t in traj.turns if t.role == "assistant")
    assert first.info["invalid_actions"] == 1 and traj.metrics["check/ok"] is True


async def test_an_openenv_mcp_envs_tools_are_the_models_tools(vault_url: str, qwen3_tokenizer: Any) -> None:
    def player(messages: list[Message], images: list[Any], sample: Sample) -> str:
        tools = [m for m in messages if m["role"] == "tool"]
        if len(tools) == 3:  # a wrong code first, and a call of a tool that is not there
            bad = [{"name": "open_vault", "arguments": {"code": "000"}}, {"name": "drill", "arguments": {}}]
            return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in bad)
        return vault_opener(messages, images, sample)

    rows = [
        Sample(f"v{i}", [{"role": "user", "content": "Open the vault."}], metadata={"seed": 41 * i + 1})
        for i in range(4)
    ]
    trajs = await collect(rows, spec(qwen3_tokenizer, {"url": vault_url}, policy_replies(player)))
    for traj in trajs:
        code = f"{(int(traj.group_id[1:]) * 41 + 1) % 1000:03d}"  # the env's code for the row's seed
        assert traj.stop_reason is StopReason.ENV_DONE and traj.num_turns == 3 and traj.reward == 1.0
        tool_texts = [m["content"] for m in traj.messages if m["role"] == "tool"]
        assert tool_texts[:3] == [f"slot {i} holds {code[i]}" for i in range(3)]
        assert (
            tool_texts[3] == "Wrong code."
            and tool_texts[4] == "Error: unknown tool 'drill'; available tools: peek, open_vault"
        )
        assert len(tool_texts) == 5 and traj.turn_rewards == [0.0, 0.0, 1.0]  # "The vault opens." ended it
        assert traj.turns[-1].info["final_observation"] == "dropped"
        assert (
            traj.info["num_tool_calls"] == 6 and traj.info["num_tool_errors"] == 1
        )  # drill never left turnrl
        assert traj.info["openenv/step_count"] == 5 and traj.info["openenv/style"] == "tools"
        prompt = qwen3_tokenizer.decode(traj.prompt_ids)
        assert "<tools>" in prompt and '"name": "peek"' in prompt  # the server's tool schemas
        assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0


async def test_the_server_is_asked_for_its_tools(vault_url: str) -> None:
    env = OpenEnvEnv(Sample("v", [{"role": "user", "content": "Open it."}]), url=vault_url)
    await env.reset()
    peek = next(t for t in env.tools if t["function"]["name"] == "peek")
    assert peek["function"]["description"] == "Show the digit in one slot of the vault's code (slots 0 to 2)."
    assert peek["function"]["parameters"]["properties"] == {"slot": {"type": "integer"}}
    result = await env.step('<tool_call>\n{"name": "peek", "arguments": {"slot": 7}}\n</tool_call>')
    assert result.observation[0]["content"] == "Error: Error calling tool 'peek': no slot 7: slots are 0 to 2"
    await env.close()


async def test_unreachable_failing_and_dying_servers_end_trajectories_with_the_reason(
    guess_url: str, qwen3_tokenizer: Any
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    (gone,) = await collect(samples(1), spec(qwen3_tokenizer, {"url": nowhere}, ["[1]"]))
    assert gone.stop_reason is StopReason.ENV_ERROR and gone.error is not None
    assert f"cannot reach the OpenEnv server at {nowhere.replace('http', 'ws')}/ws" in gone.error
    (fire,) = await collect(
        samples(1, reset_kwargs={"explode": True}), spec(qwen3_tokenizer, {"url": guess_url}, ["[1]"])
    )
    assert fire.stop_reason is StopReason.ENV_ERROR and fire.error is not None
    assert "refused reset: the game board is on fire" in fire.error
    (notools,) = await collect(
        samples(1), spec(qwen3_tokenizer, {"url": guess_url, "mode": "tools"}, ["[1]"])
    )
    assert notools.error is not None and "has no MCP tools (mode: tools)" in notools.error
    with pytest.raises(ValueError, match="mode must be one of auto, tools, action"):
        OpenEnvEnv(Sample("x", [{"role": "user", "content": "x"}]), url=guess_url, mode="gym")

    for kind in ("guess", "vault"):  # a server killed mid-episode, in each style
        proc, url = serve(kind)

        def killer(
            messages: list[Message], images: list[Any], sample: Sample, proc: Any = proc, kind: str = kind
        ) -> str:
            if len(messages) > 3:
                proc.kill()
                proc.wait()
            return vault_opener(messages, images, sample) if kind == "vault" else "[10]"

        (dead,) = await collect(samples(1), spec(qwen3_tokenizer, {"url": url}, policy_replies(killer)))
        assert dead.stop_reason is StopReason.ENV_ERROR and dead.error is not None, kind
        assert "closed the session during step" in dead.error and dead.num_turns == 2, dead.error
        stop(proc)


async def test_a_step_cut_off_by_the_env_timeout_ends_the_episode(
    guess_url: str, qwen3_tokenizer: Any
) -> None:
    """A step the rollout stops waiting for (``env_timeout_s``) may still be answered later; that
    answer must not pass for the next step's, so the episode ends there, with the reason."""
    run = spec(qwen3_tokenizer, {"url": guess_url}, ["[10]", "slowly [5]", "[7]"])
    # The slow step sleeps 2 s in the server; the bound leaves healthy calls on a loaded machine room.
    run = dataclasses.replace(run, limits=Limits(max_turns=4, env_timeout_s=1.5))
    (traj,) = await collect(samples(1), run)
    assert traj.stop_reason is StopReason.ENV_ERROR and traj.num_turns == 2, traj.error
    assert traj.error is not None and "was cut off (env_timeout_s) before its answer" in traj.error
    assert traj.messages[3]["content"] == "Lower."  # the first step's answer, in its place


async def test_episodes_go_to_the_least_busy_replica() -> None:
    sample = Sample("x", [{"role": "user", "content": "x"}])
    replicas = ["http://a:1", "http://b:1"]
    envs = [OpenEnvEnv(sample, url=replicas) for _ in range(3)]
    assert sorted(e.url for e in envs) == ["http://a:1", "http://a:1", "http://b:1"]
    await envs[0].close()  # an episode ends: its replica is less busy
    assert [OpenEnvEnv(sample, url=replicas).url for _ in range(2)] == ["http://a:1", "http://b:1"]
    assert {u: openenv_env._OPEN[u] for u in replicas} == {"http://a:1": 2, "http://b:1": 2}


def test_the_example_config_plays_the_vault_from_the_cli(tmp_path: Path, vault_url: str) -> None:
    config = yaml.safe_load((REPO / "examples" / "openenv_vault.yaml").read_text())
    config["output_dir"] = str(tmp_path / "run")
    (tmp_path / "play.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "players.py").write_text((REPO / "examples" / "players.py").read_text())
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "turnrl.cli",
            "rollout",
            str(tmp_path / "play.yaml"),
            "--set",
            f"env.kwargs.url={vault_url}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    trajs = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 8
    assert all(t["stop_reason"] == "env_done" and t["reward"] == 1.0 and t["num_turns"] == 2 for t in trajs)
