"""LLM judges as rewards: per trajectory and per group (one call), cached by content, their cost in
the metrics, a bad reply a reported reward error; and a real second model judging from the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from turnrl import ChatEncoder, Limits, RolloutSpec, Sample, SamplingParams, collect
from turnrl.app import EngineChat, Judge
from turnrl.config import JudgeConfig
from turnrl.engines.scripted import ScriptedEngine
from turnrl.env.rewards import Rewards
from turnrl.rollout.metrics import summarize
from turnrl.testing import EchoEnv

PROMPT = [{"role": "user", "content": "Name a prime number."}]


def judge_with(tokenizer: Any, replies: Any, **config: Any) -> tuple[Judge, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, replies)
    chat = EngineChat(engine, tokenizer, SamplingParams(max_tokens=64))
    return Judge(JudgeConfig(**config), chat), engine


def policy_spec(tokenizer: Any, answers: list[str], rewards: Rewards) -> RolloutSpec:
    return RolloutSpec(
        env_factory=lambda s: EchoEnv(s, done_after=1),
        engine=ScriptedEngine(tokenizer, lambda prompt, sampling: answers[sampling.seed % len(answers)]),
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=16, seed=0),
        limits=Limits(max_turns=1),
        rewards=rewards,
    )


async def test_a_judge_scores_each_trajectory_caches_repeats_and_reports_garbage(
    qwen3_tokenizer: Any,
) -> None:
    def grade(prompt: list[int], sampling: SamplingParams) -> str:
        text = qwen3_tokenizer.decode(prompt)
        if "[assistant] 7" in text:
            return "Seven is prime. Score: 10"
        if "[assistant] 9" in text:
            return "Nine is 3 * 3. Score: 2"
        return "I cannot decide."

    judge, engine = judge_with(qwen3_tokenizer, grade)
    answers = ["7", "9", "7", "banana"]
    samples = [Sample(f"p{i}", PROMPT, metadata={"answer": "any prime"}) for i in range(4)]
    spec_per_sample = [policy_spec(qwen3_tokenizer, [a], Rewards(default=judge.score)) for a in answers]
    trajs = [(await collect([s], sp))[0] for s, sp in zip(samples, spec_per_sample, strict=True)]
    assert [t.reward for t in trajs] == [1.0, 0.2, 1.0, 0.0]
    assert len(engine.calls) == 3  # the second "7" was judged from the cache
    assert [t.metrics["judge/cached"] for t in trajs] == [0, 0, 1, 0]
    assert trajs[0].metrics["judge/prompt_tokens"] > 50 and trajs[2].metrics["judge/prompt_tokens"] == 0
    assert "reward_error" not in trajs[1].metrics
    assert trajs[3].metrics["reward_error"] == "JudgeError: judge reply has no 'Score: N': 'I cannot decide.'"
    prompt_text = qwen3_tokenizer.decode(engine.calls[0].prompt_ids)
    assert "Name a prime number." in prompt_text and "any prime" in prompt_text  # task and reference
    totals = summarize(trajs)
    assert (
        totals["judge/cached"] == 1 and totals["judge/prompt_tokens"] > 150 and totals["judge/seconds"] >= 0
    )


async def test_a_judge_ranks_a_whole_group_in_one_call(qwen3_tokenizer: Any) -> None:
    judge, engine = judge_with(qwen3_tokenizer, ["Attempt 2 is best. Scores: [3, 9, 6, 0]"], mode="rank")
    spec = policy_spec(qwen3_tokenizer, ["2", "3", "5", "7"], Rewards(group_default=judge.rank))
    trajs = await collect([Sample("g", PROMPT)], spec, group_size=4)
    assert len(engine.calls) == 1  # four trajectories, one judge call
    by_index = {t.sample_index: t for t in trajs}
    assert [by_index[i].reward for i in range(4)] == [0.3, 0.9, 0.6, 0.0]
    text = qwen3_tokenizer.decode(engine.calls[0].prompt_ids)
    assert all(f"Attempt {n}:" in text for n in range(1, 5))
    assert abs(sum(t.metrics["judge/prompt_tokens"] for t in trajs) - len(engine.calls[0].prompt_ids)) < 1e-6
    short, _ = judge_with(qwen3_tokenizer, ["Scores: [1, 2]"], mode="rank")
    one = policy_spec(qwen3_tokenizer, ["2"], Rewards(group_default=short.rank))
    bad = await collect([Sample("h", PROMPT)], one, group_size=3)
    assert all(
        t.reward == 0.0 and "no 'Scores: [...]' for 3 attempts" in t.metrics["reward_error"] for t in bad
    )


def test_a_second_model_judges_from_the_cli(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    (tmp_path / "players.py").write_text("def answer(messages, images, sample):\n    return 'Paris.'\n")
    rubric = (
        "Question: {question}\nAnswer: {response}\nIs the answer correct? "
        "Reply with one line of the form 'Score: N' where N is 0 to 10.\nScore:"
    )
    config = {
        "model": str(tiny_qwen3_dir),
        "engine": {"kind": "scripted", "policy": "players:answer"},
        "env": {"name": "turnrl.testing:EchoEnv", "kwargs": {"done_after": 1}},
        "data": {"path": str(tmp_path / "rows.jsonl")},
        "judges": {"capitals": {"model": "smollm2-135m", "rubric": rubric, "sampling": {"max_tokens": 12}}},
        "limits": {"max_turns": 1},
        "rollout": {"group_size": 2},
        "output_dir": str(tmp_path / "run"),
    }
    rows = [{"id": f"q{i}", "prompt": f"What is the capital of {c}?", "data_source": "capitals"}
            for i, c in enumerate(["France", "Spain"])]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "judged.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "turnrl.cli", "rollout", "judged.yaml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trajs = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 4
    for t in trajs:  # a real judge: a score in [0, 1], or its reply reported as a reward error
        assert t["metrics"]["judge/prompt_tokens"] > 0 or t["metrics"]["judge/cached"] == 1
        assert 0.0 <= t["reward"] <= 1.0
        assert "reward_error" not in t["metrics"] or t["metrics"]["reward_error"].startswith("JudgeError")
    assert sum(t["metrics"]["judge/cached"] for t in trajs) == 2  # each question's twin answer: cached
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["judge/completion_tokens"] > 0 and summary["judge/seconds"] > 0


async def test_a_judge_as_env_feedback_grades_each_answer_until_it_passes(qwen3_tokenizer: Any) -> None:
    from turnrl.app import JudgeFeedback
    from turnrl.env.tool_env import ToolEnv

    engine = ScriptedEngine(qwen3_tokenizer, ["Too vague: name one. Score: 3", "Correct. Score: 9"])
    chat = EngineChat(engine, qwen3_tokenizer, SamplingParams(max_tokens=64))
    review = JudgeFeedback({"name": "review", "pass_score": 8, "max_rounds": 4}, chat)
    spec = RolloutSpec(
        env_factory=lambda s: ToolEnv(s, [], interactions={"review": review}),
        engine=ScriptedEngine(qwen3_tokenizer, ["Some numbers are prime.", "7 is prime."]),
        encoder=ChatEncoder(qwen3_tokenizer, {"enable_thinking": False}),
        sampling=SamplingParams(max_tokens=32),
        limits=Limits(max_turns=5),
    )
    (traj,) = await collect([Sample("f", PROMPT)], spec)
    assert traj.num_turns == 2 and traj.turn_rewards == [0.3, 0.9] and traj.stop_reason.value == "env_done"
    assert traj.messages[2]["content"] == "Too vague: name one.\nScore: 3/10"
    assert "7 is prime." in qwen3_tokenizer.decode(engine.calls[1].prompt_ids)  # the second answer graded
    assert traj.metrics["check/ok"] is True
