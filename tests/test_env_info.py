"""What envs say is kept: step info per turn, tools that end the episode, the final observation,
tool-call counts on every trajectory; on the real Qwen3 template with the strict check."""

from __future__ import annotations

import json
from typing import Any

from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.scripted import ScriptedEngine
from turnrl.env.tool_env import ToolEnv
from turnrl.record.codec import trajectory_from_json, trajectory_to_json
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.rollout.metrics import summarize, turn_record
from turnrl.tools import ToolOutput, tool
from turnrl.types import Limits, Sample, SamplingParams, StopReason

PROMPT = [{"role": "user", "content": "Find the secret number between 1 and 10."}]


@tool
def guess(n: int) -> ToolOutput:
    """Guess the secret number."""
    if n == 7:
        return ToolOutput("Correct! The secret was 7.", reward=1.0, metrics={"distance": 0}, done=True)
    return ToolOutput("higher" if n < 7 else "lower", metrics={"distance": abs(7 - n)})


def call(n: Any) -> str:
    return f'<tool_call>\n{{"name": "guess", "arguments": {{"n": {json.dumps(n)}}}}}\n</tool_call>'


def spec(tokenizer: Any, replies: list[str], **limits: Any) -> RolloutSpec:
    return RolloutSpec(
        env_factory=lambda s: ToolEnv(s, [guess]),
        engine=ScriptedEngine(tokenizer, replies),
        encoder=ChatEncoder(tokenizer, chat_template_kwargs={"enable_thinking": False}),
        sampling=SamplingParams(max_tokens=64, seed=1),
        limits=Limits(max_turns=6, **limits),
        check="strict",
    )


async def test_a_tool_that_solves_the_task_ends_the_episode_as_env_done(qwen3_tokenizer: Any) -> None:
    traj = await run_trajectory(Sample("s", PROMPT), spec(qwen3_tokenizer, [call(3), call(7), "unused"]))
    assert traj.stop_reason is StopReason.ENV_DONE, traj.error
    assert traj.num_turns == 2 and traj.reward == 1.0
    assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0
    model = [t for t in traj.turns if t.role == "assistant"]
    # each model turn keeps what its step said: the calls, the tool's own metrics
    assert [t.info["tool_metrics"] for t in model] == [[{"distance": 4}], [{"distance": 0}]]
    assert model[0].info["tool_calls"][0]["arguments"] == {"n": 3}
    # the answer "Correct!" was returned with done=True: dropped by default, and said so
    assert model[1].info["final_observation"] == "dropped"
    assert traj.turns[-1].role == "assistant"
    assert "Correct!" not in json.dumps(traj.messages)
    # the info survives the JSONL record and the turns.jsonl line
    back = trajectory_from_json(json.loads(json.dumps(trajectory_to_json(traj))))
    assert back.turns[0].info == model[0].info and back.turns[1].info == {}
    line = turn_record(traj.group_id, 0, 2, traj.turns[2])
    assert json.loads(json.dumps(line))["info"]["final_observation"] == "dropped"


async def test_the_final_observation_is_appended_masked_when_limits_ask(qwen3_tokenizer: Any) -> None:
    replies = [call(3), call(7)]
    traj = await run_trajectory(Sample("s", PROMPT), spec(qwen3_tokenizer, replies, final_observation=True))
    assert traj.stop_reason is StopReason.ENV_DONE
    last = traj.turns[-1]
    assert last.role == "tool" and "Correct! The secret was 7." in last.text
    assert traj.loss_mask[last.start : last.end] == [0] * (last.end - last.start)
    assert traj.messages[-1]["content"] == "Correct! The secret was 7."
    # the sequence is exactly the template's rendering, ending with the observation
    assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0
    assert "final_observation" not in traj.turns[-2].info


async def test_a_final_observation_over_the_budget_is_dropped_and_the_episode_is_still_done(
    qwen3_tokenizer: Any,
) -> None:
    replies = [call(7)]
    short = spec(qwen3_tokenizer, replies, final_observation=True, max_response_tokens=30)
    traj = await run_trajectory(Sample("s", PROMPT), short)
    assert traj.stop_reason is StopReason.ENV_DONE
    assert traj.turns[-1].info["final_observation"] == "dropped: over the token budget"
    assert traj.metrics["check/ok"] is True


async def test_malformed_calls_are_tool_errors_and_every_trajectory_counts_its_calls(
    qwen3_tokenizer: Any,
) -> None:
    bad = "<tool_call>\n{not json}\n</tool_call>"
    broken = await run_trajectory(Sample("a", PROMPT), spec(qwen3_tokenizer, [bad, "I give up."]))
    silent = await run_trajectory(Sample("b", PROMPT), spec(qwen3_tokenizer, ["Seven."]))
    assert broken.stop_reason is StopReason.NO_TOOL_CALL and silent.stop_reason is StopReason.NO_TOOL_CALL
    assert broken.info["num_parse_errors"] == 1 and broken.info["num_tool_errors"] == 1
    assert broken.turns[0].info["parse_errors"] and broken.metrics["check/ok"] is True
    assert silent.info["num_tool_calls"] == 0  # present even when no call was made
    summary = summarize([broken, silent])
    assert summary["tool_errors"] == 1 and summary["tool_parse_errors"] == 1 and summary["tool_calls"] == 0


async def test_info_that_json_cannot_hold_is_kept_as_text(qwen3_tokenizer: Any) -> None:
    from PIL import Image

    from turnrl.env.base import Env
    from turnrl.types import StepResult

    class Painter(Env):
        async def step(self, action: str) -> StepResult:
            return StepResult("done", done=True, info={"frame": Image.new("RGB", (2, 2)), "score": 3})

    s = RolloutSpec(
        env_factory=Painter,
        engine=ScriptedEngine(qwen3_tokenizer, ["paint"]),
        encoder=ChatEncoder(qwen3_tokenizer),
        sampling=SamplingParams(max_tokens=16),
        limits=Limits(max_turns=2),
    )
    traj = await run_trajectory(Sample("s", PROMPT), s)
    assert traj.stop_reason is StopReason.ENV_DONE
    info = traj.turns[0].info
    assert info["score"] == 3 and "PIL" in info["frame"] and traj.info["score"] == 3
    json.dumps(trajectory_to_json(traj))  # the record is still written
