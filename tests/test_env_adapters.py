"""Envs of other libraries through thin adapters, each with a real env of that library, offline:
gymnasium (text boards and rgb frames) and SkyRL-Gym (its own gsm8k envs, rows in its format).
Rollouts keep exact tokens (strict check on the Qwen3 template)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from turnrl import ChatEncoder, Limits, RolloutSpec, Sample, SamplingParams, collect
from turnrl.app.parts import build_env_factory
from turnrl.config import EnvConfig
from turnrl.engines.scripted import ScriptedEngine, policy_replies
from turnrl.env.adapters.gym_env import GymnasiumEnv, plain_ansi
from turnrl.types import Message, StopReason

pytest.importorskip("gymnasium")  # both are in the examples extra the test command installs
pytest.importorskip("skyrl_gym")

LAKE = ["[2]", "[2]", "[1]", "[1]", "[1]", "[2]"]  # right, right, down, down, down, right on the 4x4 map


def spec(tokenizer: Any, env: dict[str, Any], replies: Any, **limits: Any) -> RolloutSpec:
    return RolloutSpec(
        env_factory=build_env_factory(EnvConfig(**env)),
        engine=ScriptedEngine(tokenizer, replies),
        encoder=ChatEncoder(tokenizer, {"enable_thinking": False}),
        sampling=SamplingParams(max_tokens=32),
        limits=Limits(**{"max_turns": 8, **limits}),
    )


async def test_a_gymnasium_text_game_is_played_to_its_goal(qwen3_tokenizer: Any) -> None:
    env = {"name": "gymnasium", "kwargs": {"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False}}}
    rows = GymnasiumEnv.dataset(size=1, env_id="FrozenLake-v1")
    sample = Sample(rows[0]["id"], rows[0]["prompt"], metadata=rows[0])
    (traj,) = await collect([sample], spec(qwen3_tokenizer, env, LAKE))
    assert traj.stop_reason is StopReason.ENV_DONE and traj.num_turns == 6 and traj.reward == 1.0
    boards = [m["content"] for m in traj.messages if m["role"] == "user"]
    assert boards[0].startswith("Actions: [0] to [3].") and "(S)FFF" in boards[0]
    assert "SF(F)F" in boards[2]  # the agent, two steps right
    assert [t.info["action"] for t in traj.turns if t.role == "assistant"] == [2, 2, 1, 1, 1, 2]
    assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0


async def test_invalid_actions_and_the_envs_own_time_limit(qwen3_tokenizer: Any) -> None:
    kwargs = {"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False, "max_episode_steps": 2}}
    env = {"name": "gymnasium", "kwargs": {**kwargs, "action_names": ["left", "down", "right", "up"]}}
    sample = Sample("lake", [{"role": "system", "content": "Play."}], metadata={"seed": 0})
    (traj,) = await collect([sample], spec(qwen3_tokenizer, env, ["Hmm.", "I go up", "[0]", "[0]"]))
    assert traj.stop_reason is StopReason.MAX_TURNS  # gymnasium truncated the episode: its time limit
    assert traj.num_turns == 3 and traj.info["invalid_actions"] == 1
    assert traj.messages[3]["content"] == "No valid action found: answer with one of [0] to [3]."
    assert traj.turns[2].info["action"] == 3 and traj.metrics["check/ok"] is True


async def test_a_gymnasium_image_game_shows_frames() -> None:
    game = GymnasiumEnv(
        Sample("f", [{"role": "user", "content": "Go."}], metadata={"seed": 1}), render="rgb_array"
    )
    prompt = await game.reset()
    first = prompt[-1]["content"]
    assert first[0]["type"] == "image" and first[0]["image"].size == (256, 256)
    result = await game.step("[1]")
    assert result.observation["content"][0]["image"].size == (256, 256) and result.info["action"] == 1
    await game.close()
    with pytest.raises(ValueError, match="only discrete action spaces"):
        GymnasiumEnv(Sample("c", [{"role": "user", "content": "x"}]), env_id="Pendulum-v1", render="obs")
    assert plain_ansi("\x1b[41mS\x1b[0mFF\x1b[35mY\x1b[0m") == "(S)FFY"


def skyrl_row(index: int, truth: str, env_class: str | None = "gsm8k_multi_turn") -> dict[str, Any]:
    """A row in SkyRL's dataset format."""
    row = {
        "id": f"sky{index}",
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. Total?"}
        ],
        "reward_spec": {"method": "rule", "ground_truth": truth},
        "extra_info": {"max_turns": 3},
    }
    return row | ({"env_class": env_class} if env_class else {})


def solver(messages: list[Message], images: list[Any], sample: Sample) -> str:
    """Wrong first, right once the env asks again."""
    asked = sum(1 for m in messages if m["role"] == "user")
    return "48 + 24 = 71\n#### 71" if asked == 1 else "48 + 24 = 72\n#### 72"


async def test_skyrl_gym_envs_play_rows_in_skyrls_format(qwen3_tokenizer: Any) -> None:
    rows = [skyrl_row(0, "72"), skyrl_row(1, "72", env_class="gsm8k"), skyrl_row(2, "72", env_class=None)]
    samples = [Sample(r["id"], r["prompt"], r["data_source"], metadata=r) for r in rows]
    run = spec(qwen3_tokenizer, {"name": "skyrl_gym"}, policy_replies(solver), max_turns=4)
    trajs = {t.group_id: t for t in await collect(samples, run)}
    multi, single, unnamed = trajs["sky0"], trajs["sky1"], trajs["sky2"]
    assert multi.stop_reason is StopReason.ENV_DONE and multi.num_turns == 2
    assert multi.turn_rewards[1] == 1.0 and 0 < multi.turn_rewards[0] < 1  # SkyRL's format score, then right
    assert multi.reward == pytest.approx(sum(multi.turn_rewards))
    assert re.search(r"step-by-step reasoning", multi.messages[2]["content"])  # SkyRL's own observation
    assert multi.info["skyrl/steps"] == 2 and multi.metrics["check/ok"] is True
    assert single.stop_reason is StopReason.ENV_DONE and single.num_turns == 1 and single.reward == 0.0
    assert unnamed.stop_reason is StopReason.ENV_ERROR
    assert unnamed.error is not None and "has no env_class and the config gives no env_id" in unnamed.error
