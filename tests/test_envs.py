"""The ready-made envs driven by hand-written model turns, and every example config."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym

from turnrl.app import load_samples
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import load_config
from turnrl.data import read_rows, sample_from_row, to_samples
from turnrl.engines.scripted import ScriptedEngine
from turnrl.env.adapters.textarena_env import TextArenaEnv, drop_echo, new_part
from turnrl.env.base import Env
from turnrl.env.builtin.guess_number import GuessNumberEnv, parse_guess, secret_for
from turnrl.env.builtin.math_tools import MathToolEnv, answers_match, extract_answer
from turnrl.env.builtin.swift_scheduler import SchedulerEnv, ThinkingTipsEnv
from turnrl.env.builtin.tool_config import AnswerCheckTool, ConfiguredToolEnv, answer_reward
from turnrl.env.registry import resolve_env
from turnrl.env.rewards import RewardContext
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.types import Limits, Message, Sample, SamplingParams, StopReason, Trajectory, Turn

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TOOLS_YAML = EXAMPLES / "tools" / "calculator.yaml"
TOOL_ROWS = EXAMPLES / "data" / "tool_rows.jsonl"


def trajectory(*texts: str) -> Trajectory:
    """A trajectory whose model turns said ``texts`` (tokens are irrelevant to scoring)."""
    turns = [Turn(role="assistant", start=0, end=0, text=t) for t in texts]
    return Trajectory(
        id="t/0", group_id="t", data_source="test", stop_reason=StopReason.ENV_DONE, turns=turns,
    )  # fmt: skip


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def samples_of(rows: list[dict[str, Any]]) -> list[Sample]:
    return to_samples(rows, "test")


# --- answers ---------------------------------------------------------------------------------------


def test_extract_answer_prefers_the_last_answer_tag_then_the_last_number() -> None:
    assert extract_answer("<answer>3</answer> no, <answer> 4 </answer>") == "4"
    assert extract_answer("it is 1,234 or maybe 17.5 apples") == "17.5"
    assert extract_answer("<think>12</think>the total is 1,234.") == "1234"
    assert extract_answer("no digits") is None
    assert answers_match("42.0", "42") and answers_match("paris.", "Paris")
    assert not answers_match(None, "1") and not answers_match("41", "42")


# --- math_tools -----------------------------------------------------------------------------------


def math_samples() -> list[Sample]:
    return samples_of(MathToolEnv.dataset(size=3, seed=5))


def test_math_dataset_interleaves_tasks_and_keeps_the_entry() -> None:
    samples = math_samples()
    assert [s.data_source for s in samples] == ["basic_arithmetic", "gsm_symbolic"] * 3
    for s in samples:
        rebuilt = reasoning_gym.create_dataset(s.data_source, seed=5, size=3)[s.metadata["index"]]
        assert rebuilt["question"] == s.metadata["entry"]["question"] == s.prompt[-1]["content"]
        assert s.prompt[0]["role"] == "system" and "<answer>" in s.prompt[0]["content"]


async def test_math_env_runs_the_calculator_then_ends_without_a_tool_call() -> None:
    sample = math_samples()[0]
    env = MathToolEnv(sample)
    assert await env.reset() == sample.prompt
    assert env.tools is not None and [t["function"]["name"] for t in env.tools] == ["calculator"]
    expression = sample.metadata["entry"]["metadata"]["expression"]
    result = await env.step(f"Let me compute. {call('calculator', expression=expression)}")
    assert not result.done and result.info["num_tool_calls"] == 1
    [message] = env.format_observation(result.observation)
    assert message["role"] == "tool" and message["content"] == sample.metadata["answer"]
    final = await env.step(f"<answer>{message['content']}</answer>")
    assert final.done and final.stop_reason is StopReason.NO_TOOL_CALL
    await env.close()


@pytest.mark.parametrize("task_index", [0, 1])
async def test_math_score_is_the_task_verifier(task_index: int) -> None:
    sample = math_samples()[task_index]
    entry, answer = sample.metadata["entry"], sample.metadata["answer"]
    verifier = reasoning_gym.create_dataset(sample.data_source, seed=5, size=3)
    env = MathToolEnv(sample)
    assert (
        await env.score(trajectory(call("calculator", expression="1+1"), f"<answer>{answer}</answer>")) == 1.0
    )
    wrong = str(int(float(answer)) + 1)
    score = await env.score(trajectory(f"so the answer is {wrong}"))
    assert score == verifier.score_answer(wrong, entry) < 1.0
    if sample.data_source == "gsm_symbolic":
        assert score == 0.01  # gsm_symbolic's own verifier gives a wrong number a little credit
    assert await env.score(trajectory("I do not know")) == verifier.score_answer(None, entry) == 0.0


# --- guess_number ---------------------------------------------------------------------------------


def test_parse_guess() -> None:
    assert parse_guess("maybe 3, no: [12]") == 12
    assert parse_guess("I say 7 then 9") == 9
    assert parse_guess("<think>[5]</think>no idea") is None


async def test_guess_number_hints_then_rewards_a_correct_guess_by_turns_used() -> None:
    [sample] = samples_of(GuessNumberEnv.dataset(size=1, hi=20, seed=3))
    secret = secret_for(sample.metadata["seed"], 20)
    env = GuessNumberEnv(sample)
    assert env.secret == secret and await env.reset() == sample.prompt
    low, high = (secret - 1, secret + 1) if 1 < secret < 20 else (secret, secret)
    if low != secret:
        result = await env.step(f"[{low}]")
        assert env.format_observation(result.observation)[0]["content"].startswith("Higher")
    if high != secret:
        result = await env.step(f"I guess {high}")
        assert env.format_observation(result.observation) == [
            {"role": "user", "content": "Lower. Guess again."}
        ]
    invalid = await env.step("[99]")
    assert not invalid.done and "Invalid" in invalid.observation and invalid.info["invalid_guesses"] == 1
    done = await env.step(f"[{secret}]")
    expected = 0.9 ** (env.guesses - 1)
    assert done.done and done.reward == pytest.approx(expected)
    assert await env.score(trajectory()) == pytest.approx(expected)


async def test_guess_number_without_success_scores_zero_and_respects_max_guesses() -> None:
    sample = sample_from_row({"prompt": "guess", "seed": 1, "hi": 5}, 0)
    env = GuessNumberEnv(sample, max_guesses=2)
    wrong = 1 if env.secret != 1 else 2
    assert not (await env.step(f"[{wrong}]")).done
    last = await env.step(f"[{wrong}]")
    assert last.done and last.reward == 0.0 and await env.score(trajectory()) == 0.0


def test_guess_number_dataset_is_deterministic() -> None:
    rows = GuessNumberEnv.dataset(size=8, hi=20, seed=0)
    assert rows == GuessNumberEnv.dataset(size=8, hi=20, seed=0)
    assert len({r["seed"] for r in rows}) == 8 and rows != GuessNumberEnv.dataset(size=8, seed=1)


# --- textarena ------------------------------------------------------------------------------------


def test_new_part_and_drop_echo() -> None:
    assert new_part("abc", "abcdef") == "def" and new_part("xyz", "abc") == "abc"
    assert drop_echo("\n[Player] [1 2]\n[GAME] hi", "[1 2]") == "\n[GAME] hi"
    assert drop_echo("\n[Player] [go]\n[GAME] hi", "go") == "\n[GAME] hi"
    assert drop_echo("\n[GAME] hi", "go") == "\n[GAME] hi"


def mastermind(seed: int = 0, **kwargs: Any) -> TextArenaEnv:
    [sample] = samples_of(TextArenaEnv.dataset(env_id="Mastermind-v0", size=1, seed=seed))
    return TextArenaEnv(
        sample, env_id="Mastermind-v0", env_kwargs={"code_length": 3, "max_turns": 4}, **kwargs
    )


async def test_textarena_observations_are_only_the_new_part() -> None:
    env = mastermind(system_prompt="Guess in brackets.")
    prompt = await env.reset()
    assert [m["role"] for m in prompt] == ["system", "user"] and "Mastermind" in prompt[1]["content"]
    code = env._game.state.game_state["secret_code"]
    wrong = [d for d in range(1, 7) if d not in code][:1] + code[:2]
    result = await env.step(f"My guess: [{' '.join(map(str, wrong))}]")
    [message] = env.format_observation(result.observation)
    assert message["role"] == "user" and message["content"].startswith("[GAME] Submitted")
    assert "Mastermind" not in message["content"] and "My guess" not in message["content"]
    invalid = await env.step("no brackets here")
    assert "invalid move" in invalid.observation and "Submitted" not in invalid.observation
    done = await env.step(f"[{' '.join(map(str, code))}]")
    assert done.done and done.reward == 1.0 and await env.score(trajectory()) == 1.0
    await env.close()


async def test_textarena_can_keep_the_echo_and_scores_zero_when_unfinished() -> None:
    env = mastermind(echo_actions=True)
    await env.reset()
    result = await env.step("[1 2 3]")
    assert result.observation.startswith("[Player] [1 2 3]")
    assert await env.score(trajectory()) == 0.0


async def test_textarena_games_are_seeded_per_row_and_leave_global_random_alone() -> None:
    random.seed(123)
    expected = random.random()
    random.seed(123)
    a, b, c = mastermind(seed=0), mastermind(seed=0), mastermind(seed=1)
    for env in (a, b, c):
        await env.reset()
    assert random.random() == expected
    codes = [e._game.state.game_state["secret_code"] for e in (a, b, c)]
    assert codes[0] == codes[1]
    assert TextArenaEnv.dataset(env_id="Mastermind-v0", size=2)[0]["seed"] != c.seed


async def test_textarena_guess_the_number_runs_offline() -> None:
    [sample] = samples_of(TextArenaEnv.dataset(size=1))
    env = TextArenaEnv(sample)
    await env.reset()
    secret = env._game.state.game_state["game_number"]
    result = await env.step(f"[{secret % 20 + 1}]")
    assert "The target number is" in result.observation
    done = await env.step(f"[{secret}]")
    assert done.done and done.reward == 1.0


# --- swift scheduler ------------------------------------------------------------------------------


async def test_thinking_tips_env_tips_until_right() -> None:
    [sample] = samples_of(ThinkingTipsEnv.dataset(size=1, seed=2))
    answer = sample.metadata["answer"]
    env = ThinkingTipsEnv(sample, max_turns=3)
    await env.reset()
    wrong = await env.step("<answer>-1000</answer>")
    assert not wrong.done
    assert env.format_observation(wrong.observation) == [
        {"role": "user", "content": ThinkingTipsEnv.tips_prompt}
    ]
    missing = await env.step("hmm, let me think")
    assert not missing.done
    right = await env.step(f"<answer>{answer}</answer>")
    assert right.done and env.turn == 3
    assert [m["role"] for m in env.messages][-5:] == ["assistant", "user", "assistant", "user", "assistant"]
    assert await env.score(trajectory("<answer>-1000</answer>", f"<answer>{answer}</answer>")) == 1.0
    assert await env.score(trajectory(f"<answer>{answer}</answer>", "<answer>-1000</answer>")) == 0.0


async def test_thinking_tips_env_stops_at_max_turns() -> None:
    [sample] = samples_of(ThinkingTipsEnv.dataset(size=1))
    env = ThinkingTipsEnv(sample, max_turns=2)
    await env.reset()
    assert not (await env.step("no idea")).done
    assert (await env.step("still no idea")).done


class CountdownScheduler(SchedulerEnv):
    """Says how many turns are left; tells nothing (ends) once the model writes 'stop'."""

    def __init__(self, sample: Sample) -> None:
        super().__init__(sample, max_turns=4)
        self.seen: list[tuple[list[Message], str, int]] = []

    def check_finished(self, messages: list[Message], response_text: str, turn: int) -> bool:
        self.seen.append((messages, response_text, turn))
        return super().check_finished(messages, response_text, turn)

    def next_messages(self, messages: list[Message], response_text: str, turn: int) -> list[Message]:
        if "stop" in response_text:
            return []
        return [{"role": "user", "content": f"{self.data_dict['budget'] - turn} left"}]


async def test_scheduler_env_hooks_see_the_running_messages() -> None:
    env = CountdownScheduler(sample_from_row({"prompt": "count", "budget": 4}, 0))
    await env.reset()
    first = await env.step("one")
    assert first.observation == [{"role": "user", "content": "3 left"}]
    messages, text, turn = env.seen[0]
    assert (text, turn) == ("one", 1) and messages[-1] == {"role": "assistant", "content": "one"}
    assert [m["content"] for m in env.messages] == ["count", "one", "3 left"]
    assert (await env.step("stop")).done


async def test_scheduler_env_rejects_non_messages() -> None:
    class Bad(SchedulerEnv):
        def next_messages(self, messages: list[Message], response_text: str, turn: int) -> list[Message]:
            return ["not a message"]  # type: ignore[list-item]

    env = Bad(sample_from_row({"prompt": "x"}, 0))
    await env.reset()
    with pytest.raises(TypeError, match="chat messages"):
        await env.step("hi")


# --- tool_config ----------------------------------------------------------------------------------


def tool_samples() -> dict[str, Sample]:
    return {s.id: s for s in to_samples(read_rows(TOOL_ROWS), str(TOOL_ROWS))}


def tool_names(env: Env) -> list[str]:
    return [t["function"]["name"] for t in env.tools or []]


async def test_tool_rows_select_their_tools() -> None:
    samples = tool_samples()
    assert len({s.data_source for s in samples.values()}) == 3
    expected = {"calc-1": ["calculator"], "fact-1": ["check_answer"], "all-1": ["calculator", "check_answer"]}
    for sample_id, names in expected.items():
        env = ConfiguredToolEnv(samples[sample_id], tools_config=str(TOOLS_YAML))
        assert tool_names(env) == names
    env = ConfiguredToolEnv(samples["calc-1"], tools_config=str(TOOLS_YAML))
    await env.reset()
    result = await env.step(call("check_answer", answer="1517") + call("calculator", expression="37 * 41"))
    [unknown, calc] = env.format_observation(result.observation)
    assert "unknown tool 'check_answer'" in unknown["content"] and calc["content"] == "1517"
    assert await env.score(trajectory()) is None  # no reward tool: the data source's reward fn decides
    await env.close()


async def test_reward_tool_uses_the_rows_ground_truth() -> None:
    sample = tool_samples()["check-1"]
    env = ConfiguredToolEnv(sample, tools_config=str(TOOLS_YAML))
    await env.reset()
    first = await env.step(call("check_answer", answer="500"))
    assert "not correct" in first.observation[0]["content"]
    assert await env.score(trajectory()) == 0.0
    second = await env.step(
        call("calculator", expression="123 + 456 - 78") + call("check_answer", answer="501")
    )
    assert second.observation[1]["content"] == "Answer '501' is correct."
    assert await env.score(trajectory()) == 1.0
    tool = next(t for t in env._tools.values() if isinstance(t, AnswerCheckTool))
    assert env.instance_id in tool._attempts
    await env.close()
    assert env.instance_id not in tool._attempts


async def test_reward_tool_without_ground_truth_fails_at_reset() -> None:
    sample = sample_from_row({"prompt": "q", "tools": ["check_answer"]}, 0)
    with pytest.raises(ValueError, match="ground_truth"):
        await ConfiguredToolEnv(sample, tools_config=str(TOOLS_YAML)).reset()


async def test_answer_reward_for_rows_without_a_reward_tool() -> None:
    sample = tool_samples()["calc-1"]
    env = ConfiguredToolEnv(sample, tools_config=str(TOOLS_YAML))
    right = RewardContext(
        sample, trajectory(call("calculator", expression="37*41"), "<answer>1517</answer>"), env
    )
    wrong = RewardContext(sample, trajectory("<answer>1500</answer>"), env)
    assert answer_reward(right) == 1.0 and answer_reward(wrong) == 0.0


# --- through the turn loop, with the real Qwen3 chat template ---------------------------------------


@pytest.fixture(scope="module")
def qwen3_encoder() -> ChatEncoder:
    from transformers import AutoTokenizer

    from turnrl.models import qwen3_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(), local_files_only=True)
    return ChatEncoder(tokenizer, {"enable_thinking": False})


async def run_scripted(encoder: ChatEncoder, env: Env, replies: list[str], max_turns: int = 4) -> Trajectory:
    engine = ScriptedEngine(encoder.template.tokenizer, replies)
    spec = RolloutSpec(
        lambda _: env, engine, encoder, SamplingParams(max_tokens=64), Limits(max_turns=max_turns)
    )
    return await run_trajectory(env.sample, spec)


async def test_tool_env_trajectory_is_exact_and_rewarded_by_the_reward_tool(
    qwen3_encoder: ChatEncoder,
) -> None:
    env = ConfiguredToolEnv(tool_samples()["check-1"], tools_config=str(TOOLS_YAML))
    replies = [
        call("calculator", expression="123 + 456 - 78"),
        call("check_answer", answer="501"),
        "Done: 501.",
    ]
    traj = await run_scripted(qwen3_encoder, env, replies)
    assert traj.stop_reason is StopReason.NO_TOOL_CALL and traj.num_turns == 3
    assert traj.reward == 1.0 and traj.metrics["check/ok"] and traj.info["num_tool_calls"] == 2
    tool_turns = [t for t in traj.turns if t.role != "assistant"]
    assert [t.text.count("501") for t in tool_turns] == [1, 1]
    assert all(m == 0 for t in tool_turns for m in traj.loss_mask[t.start : t.end])


async def test_textarena_trajectory_appends_only_new_observations(qwen3_encoder: ChatEncoder) -> None:
    probe = mastermind(seed=4)
    await probe.reset()
    code = " ".join(map(str, probe._game.state.game_state["secret_code"]))
    env = mastermind(seed=4)
    traj = await run_scripted(qwen3_encoder, env, ["[1 2 3]" if code != "1 2 3" else "[4 5 6]", f"[{code}]"])
    assert traj.stop_reason is StopReason.ENV_DONE and traj.reward == 1.0 and traj.metrics["check/ok"]
    [observation] = [m for m in traj.messages[2:] if m["role"] == "user"]
    assert (
        observation["content"].startswith("[GAME] Submitted") and "Mastermind" not in observation["content"]
    )


# --- examples -------------------------------------------------------------------------------------

EXAMPLE_CONFIGS = sorted(p for p in EXAMPLES.glob("*.yaml") if not p.stem.startswith("train_"))
TRAIN_CONFIGS = sorted(EXAMPLES.glob("train_*.yaml"))


def test_every_example_is_listed() -> None:
    names = {p.stem for p in EXAMPLE_CONFIGS}
    assert {"math_tools", "guess_number", "textarena_mastermind", "swift_scheduler", "tool_config"} <= names
    readme = (EXAMPLES / "README.md").read_text()
    assert all(f"examples/{p.name}" in readme for p in EXAMPLE_CONFIGS + TRAIN_CONFIGS)


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.stem)
def test_train_example_config_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from turnrl.train.config import load_train_config

    monkeypatch.chdir(REPO)
    config = load_train_config(path)
    resolve_env(config.env.name)


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.stem)
async def test_example_config_loads_and_its_env_starts(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # paths in the examples are relative to the repository root
    config = load_config(path)
    entry = resolve_env(config.env.name)
    samples = load_samples(config.data, entry)
    assert len(samples) * config.rollout.group_size <= 32 and config.sampling.max_tokens <= 128
    assert config.limits.max_turns <= 4
    server = None
    if config.env.name == "openenv":  # its env lives in a server the user starts first: start it
        from openenv_helpers import serve

        server, url = serve(path.stem.removeprefix("openenv_"))
        config.env.kwargs["url"] = url
    env = entry.bind(config.env.kwargs)(samples[0])
    try:
        prompt = await env.reset()
        assert prompt and all("role" in m for m in prompt)
    finally:
        await env.close()
        if server is not None:
            server.terminate()
            server.wait(timeout=10)


async def test_textarena_scores_a_game_lost_by_invalid_moves_as_lost() -> None:
    """textarena pays a GuessTheNumber lost through invalid moves its percentage completion; a lost
    game scores 0.0 unless ``partial_credit`` keeps textarena's value."""
    [sample] = samples_of(TextArenaEnv.dataset(size=1))
    for partial in (False, True):
        env = TextArenaEnv(sample, partial_credit=partial)
        await env.reset()
        secret = env._game.state.game_state["game_number"]
        near = secret + 1 if secret < 20 else secret - 1
        result = await env.step(f"[{near}]")
        for _ in range(6):  # the same guess again is an invalid move, until the game ends
            if result.done:
                break
            result = await env.step(f"[{near}]")
        assert result.done and result.info["invalid_move"] == 1 and result.info["textarena_reward"] > 0
        assert result.reward == (result.info["textarena_reward"] if partial else 0.0)
        assert await env.score(trajectory()) == result.reward
        await env.close()
