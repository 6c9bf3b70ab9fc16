"""The turn loop and the collector: exact tokens, every stop reason, failures that end well."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.hf import HFEngine
from turnrl.engines.scripted import ScriptedEngine, ScriptedReply
from turnrl.env.rewards import RewardContext, Rewards
from turnrl.env.tool_env import ToolEnv
from turnrl.rollout.collector import collect, read_trajectories
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.rollout.metrics import summarize
from turnrl.testing import BrokenResetEnv, EchoEnv, FlakyEnv
from turnrl.tools import FunctionTool
from turnrl.tools.builtin import calculator
from turnrl.types import Generation, Limits, Sample, SamplingParams, StopReason, Trajectory

PROMPT = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 17*23+4?"},
]
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


def tool_env(sample: Sample) -> ToolEnv:
    return ToolEnv(sample, [FunctionTool(calculator)])


def spec_for(engine: Any, tokenizer: Any, env: Any, **limits: Any) -> RolloutSpec:
    return RolloutSpec(
        env_factory=env,
        engine=engine,
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=limits.pop("max_tokens", 64), seed=limits.pop("seed", None)),
        limits=Limits(**{"max_turns": 4, "env_timeout_s": 2.0, **limits}),
    )


async def run(spec: RolloutSpec, prompt: list[dict[str, Any]] = PROMPT) -> Trajectory:
    return await run_trajectory(Sample("s0", prompt, data_source="calc"), spec)


def assert_record_consistent(traj: Trajectory) -> None:
    n = len(traj.response_ids)
    assert len(traj.loss_mask) == n == len(traj.rollout_logprobs)
    assert all(lp == 0.0 for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m == 0)
    spans = [(t.start, t.end) for t in traj.turns]
    assert spans == sorted(spans) and (not spans or spans[-1][1] == n)
    for t in traj.turns:
        assert set(traj.loss_mask[t.start : t.end]) <= ({1} if t.role == "assistant" else {0})


async def test_tool_rollout_equals_full_rerender(qwen3_tokenizer: Any) -> None:
    replies = [
        "<think>\nFirst the product.\n</think>\n\n" + CALL.format("17*23"),
        "<think>\nNow add.\n</think>\n\nAdding 4.\n" + CALL.format("391+4"),
        "<think>\nDone.\n</think>\n\n<answer>395</answer>",
    ]
    engine = ScriptedEngine(qwen3_tokenizer, replies)
    traj = await run(spec_for(engine, qwen3_tokenizer, tool_env))
    assert traj.stop_reason == StopReason.NO_TOOL_CALL and traj.num_turns == 3
    assert_record_consistent(traj)
    # the mask-1 spans are exactly what the engine returned, in order
    model_spans = [traj.response_ids[t.start : t.end] for t in traj.turns if t.role == "assistant"]
    sequence = traj.prompt_ids + traj.response_ids
    for call, span in zip(engine.calls, model_spans, strict=True):
        # each generation conditioned on exactly the sequence before its span
        assert sequence[: len(call.prompt_ids)] == call.prompt_ids
        assert sequence[len(call.prompt_ids) : len(call.prompt_ids) + len(span)] == span
    # strict sanity check: the whole sequence equals a full re-render of the final messages
    assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0
    plain = [{k: v for k, v in m.items() if k != "tool_calls"} for m in traj.messages]
    rendered = qwen3_tokenizer.apply_chat_template(
        plain, tools=tool_env(Sample("x", [])).tools, tokenize=False
    )
    assert sequence + qwen3_tokenizer.encode("\n", add_special_tokens=False) == qwen3_tokenizer.encode(
        rendered, add_special_tokens=False
    )
    text = qwen3_tokenizer.decode(sequence)
    assert text.count("# Tools") == 1 and text.count("<|im_start|>system") == 1
    assert (
        "<tool_response>\n391\n</tool_response>" in text and "<tool_response>\n395\n</tool_response>" in text
    )
    assert traj.messages[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "17*23"}


async def test_malformed_call_and_tool_exception_are_observations(qwen3_tokenizer: Any) -> None:
    replies = [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>',
        CALL.format("1/0"),
        "<answer>0</answer>",
    ]
    engine = ScriptedEngine(qwen3_tokenizer, replies)
    traj = await run(spec_for(engine, qwen3_tokenizer, tool_env))
    assert traj.stop_reason == StopReason.NO_TOOL_CALL and traj.num_turns == 3
    seen = qwen3_tokenizer.decode(engine.prompts[1])
    assert "Error:" in seen.split("<tool_response>")[-1]  # the model saw the parse error
    assert "ZeroDivisionError" in qwen3_tokenizer.decode(engine.prompts[2]).split("<tool_response>")[-1]
    # the malformed call is a tool error too (of the kind parse error), beside the raising tool
    assert traj.info["num_tool_errors"] == 2 and traj.info["num_parse_errors"] == 1
    assert summarize([traj])["tool_parse_errors"] == 1 and summarize([traj])["tool_errors"] == 2


@pytest.mark.parametrize(
    ("env", "limits", "replies", "expected"),
    [
        (lambda s: EchoEnv(s, done_after=2), {}, ["a", "b"], StopReason.ENV_DONE),
        (EchoEnv, {"max_turns": 3}, ["a", "b", "c"], StopReason.MAX_TURNS),
        (EchoEnv, {"max_context_tokens": 40}, ["word " * 30], StopReason.TOKEN_BUDGET),
        (EchoEnv, {"max_tokens": 5}, ["word " * 30], StopReason.LENGTH),
        (EchoEnv, {}, [ScriptedReply(text="partial", finish_reason="abort")], StopReason.ABORTED),
        (EchoEnv, {}, [RuntimeError("server gone")], StopReason.ENGINE_ERROR),
        (lambda s: FlakyEnv(s, failures=5), {"max_env_retries_per_turn": 2}, ["a"], StopReason.ENV_ERROR),
        (BrokenResetEnv, {}, [], StopReason.ENV_ERROR),
    ],
)
async def test_every_stop_reason(
    qwen3_tokenizer: Any, env: Any, limits: dict[str, Any], replies: list[Any], expected: StopReason
) -> None:
    prompt = [{"role": "user", "content": "Hi"}]
    traj = await run(
        spec_for(ScriptedEngine(qwen3_tokenizer, replies), qwen3_tokenizer, env, **limits), prompt
    )
    assert traj.stop_reason == expected, traj.error
    assert_record_consistent(traj)
    assert len(traj.prompt_ids) + len(traj.response_ids) <= limits.get("max_context_tokens", 4096)
    assert (traj.error is not None) == (expected in (StopReason.ENV_ERROR, StopReason.ENGINE_ERROR))


async def test_observation_that_would_overflow_is_not_appended(qwen3_tokenizer: Any) -> None:
    prompt = [{"role": "user", "content": "Hi"}]
    long_reply = lambda s: EchoEnv(s, reply="very long observation " * 20)  # noqa: E731
    spec = spec_for(
        ScriptedEngine(qwen3_tokenizer, ["ok", "ok"]), qwen3_tokenizer, long_reply, max_context_tokens=60
    )
    traj = await run(spec, prompt)
    assert traj.stop_reason == StopReason.TOKEN_BUDGET and traj.truncated
    assert traj.turns[-1].role == "assistant"  # the overflowing observation was left out whole


async def test_env_retries_and_timeouts_recover(qwen3_tokenizer: Any) -> None:
    prompt = [{"role": "user", "content": "Hi"}]
    flaky = lambda s: FlakyEnv(s, failures=1, done_after=2)  # noqa: E731
    traj = await run(spec_for(ScriptedEngine(qwen3_tokenizer, ["a", "b"]), qwen3_tokenizer, flaky), prompt)
    assert traj.stop_reason == StopReason.ENV_DONE and traj.metrics["env_retries"] == 2
    hanging = lambda s: FlakyEnv(s, failures=1, hang=True, done_after=1)  # noqa: E731
    spec = spec_for(ScriptedEngine(qwen3_tokenizer, ["a"]), qwen3_tokenizer, hanging, env_timeout_s=0.05)
    traj = await run(spec, prompt)
    assert traj.stop_reason == StopReason.ENV_DONE and traj.metrics["env_retries"] == 1
    broken = spec_for(ScriptedEngine(qwen3_tokenizer, []), qwen3_tokenizer, BrokenResetEnv)
    traj = await run(broken, prompt)  # three attempts: the first and two retries, all failed
    assert traj.metrics["env_failures"] == {"RuntimeError": 3} and traj.metrics["env_retries"] == 2
    always = lambda s: FlakyEnv(s, failures=9, hang=True)  # noqa: E731
    spec = spec_for(ScriptedEngine(qwen3_tokenizer, ["a"]), qwen3_tokenizer, always, env_timeout_s=0.05)
    traj = await run(spec, prompt)
    assert traj.stop_reason == StopReason.ENV_ERROR and "timed out" in (traj.error or "")


async def test_reward_routing_and_close_always_runs(qwen3_tokenizer: Any) -> None:
    envs: list[EchoEnv] = []

    def make(sample: Sample) -> EchoEnv:
        envs.append(EchoEnv(sample, done_after=1, reward=0.25))
        return envs[-1]

    def reward(ctx: RewardContext) -> float:
        return 10.0 if ctx.final_text == "a" else 0.0

    spec = spec_for(ScriptedEngine(qwen3_tokenizer, ["a", RuntimeError("boom")]), qwen3_tokenizer, make)
    spec.rewards = Rewards(by_source={"calc": reward})
    assert (await run(spec)).reward == 10.0
    spec.rewards = Rewards()
    assert (await run(spec)).stop_reason == StopReason.ENGINE_ERROR
    assert all(e.closed for e in envs)


class RecordingEngine:
    """Wraps a real engine and keeps every generation it returned."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.generations: list[list[int]] = []

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Any = (),
        *,
        session: str | None = None,
    ) -> Generation:
        gen = await self.inner.generate(prompt_ids, sampling)
        self.generations.append(list(gen.token_ids))
        return gen

    async def close(self) -> None:
        await self.inner.close()


async def test_real_engine_rollouts_are_exact(
    tiny_qwen3_model: Any, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    engine = RecordingEngine(HFEngine(tiny_qwen3_model, qwen3_tokenizer, max_batch_size=8, seed=0))
    spec = spec_for(engine, qwen3_tokenizer, lambda s: EchoEnv(s, done_after=3), max_tokens=12, seed=7)
    samples = [Sample(f"p{i}", [{"role": "user", "content": f"Count to {i}."}]) for i in range(4)]
    out = tmp_path / "trajectories.jsonl"
    trajs = await collect(samples, spec, group_size=2, concurrency=8, out_path=out)
    assert len(trajs) == 8 and sorted(t.id for t in trajs) == sorted(
        f"p{i}/{k}" for i in range(4) for k in range(2)
    )
    assert read_trajectories(out) == trajs or [t.id for t in read_trajectories(out)] == [t.id for t in trajs]
    lines = out.read_text().splitlines()
    assert len(lines) == 8 and json.loads(lines[0])["stop_reason"] in {r.value for r in StopReason}
    returned = {tuple(g) for g in engine.generations}
    by_id = {t.id: t for t in trajs}
    for i in range(4):  # a group's samples differ: each request gets its own seed
        assert by_id[f"p{i}/0"].response_ids != by_id[f"p{i}/1"].response_ids
    again = await run_trajectory(samples[0], spec, 1)  # and the seeds make them reproducible
    assert again.response_ids == by_id["p0/1"].response_ids
    await engine.close()
    for traj in trajs:
        assert_record_consistent(traj)
        assert traj.group_id == traj.id.split("/")[0]
        for t in traj.turns:
            if t.role == "assistant":
                assert tuple(traj.response_ids[t.start : t.end]) in returned
        # a fresh forward pass over the final sequence reproduces the rollout logprobs
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logits = tiny_qwen3_model(ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        p = len(traj.prompt_ids)
        for i, (lp, m) in enumerate(zip(traj.rollout_logprobs, traj.loss_mask, strict=True)):
            if m:
                assert abs(float(logprobs[p + i - 1]) - lp) < 2e-3


async def test_non_canonical_sampled_tokens_are_kept_and_reported(qwen3_tokenizer: Any) -> None:
    newline = qwen3_tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1 and len(qwen3_tokenizer.encode("\n\n", add_special_tokens=False)) == 1
    hi, there = (qwen3_tokenizer.encode(w, add_special_tokens=False) for w in ("Hi", "there"))
    reply = ScriptedReply(token_ids=[*hi, *newline, *newline, *there])  # "\n\n" as two tokens
    engine = ScriptedEngine(qwen3_tokenizer, [reply])
    traj = await run(spec_for(engine, qwen3_tokenizer, lambda s: EchoEnv(s, done_after=1)))
    assert traj.response_ids[: len(hi) + 2] == [*hi, *newline, *newline]  # kept exactly as sampled
    assert traj.metrics["check/ok"] is True and traj.metrics["check/expected_diffs"] >= 1
    kinds = [(h["kind"], h["expected"]) for h in traj.info["check"]["hunks"]]
    assert ("same_text", True) in kinds


class BadObservationEnv(EchoEnv):
    def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        raise KeyError("no such field")


async def test_bad_observation_or_prompt_ends_only_that_trajectory(qwen3_tokenizer: Any) -> None:
    engine = ScriptedEngine(qwen3_tokenizer, ["a", "b", "c"])
    spec = spec_for(engine, qwen3_tokenizer, BadObservationEnv)
    samples = [
        Sample("bad-obs", [{"role": "user", "content": "Hi"}]),
        Sample("bad-prompt", [{"role": "user"}]),
    ]
    trajs = {t.group_id: t for t in await collect(samples, spec)}
    assert trajs["bad-obs"].stop_reason == StopReason.ENV_ERROR and trajs["bad-obs"].num_turns == 1
    assert "observation: KeyError" in (trajs["bad-obs"].error or "")
    assert trajs["bad-prompt"].stop_reason == StopReason.ENV_ERROR
    assert (trajs["bad-prompt"].error or "").startswith("prompt:")


async def test_summary_names_the_most_common_errors(qwen3_tokenizer: Any) -> None:
    from turnrl.rollout.metrics import summarize

    prompt = [{"role": "user", "content": "Hi"}]
    broken = [
        await run(spec_for(ScriptedEngine(qwen3_tokenizer, []), qwen3_tokenizer, BrokenResetEnv), prompt)
    ]
    gone = ScriptedEngine(qwen3_tokenizer, [RuntimeError("server gone")] * 2)
    failed = [await run(spec_for(gone, qwen3_tokenizer, EchoEnv), prompt) for _ in range(2)]
    fine = await run(
        spec_for(ScriptedEngine(qwen3_tokenizer, ["a"]), qwen3_tokenizer, EchoEnv, max_turns=1), prompt
    )
    top = summarize([*broken, *failed, fine])["errors/top"]
    assert list(top.values()) == [2, 1] and "server gone" in next(iter(top))
    assert broken[0].error in top


class _ContextTurnEnv(EchoEnv):
    """Marks its first answered model turn as context (a warm-up turn the env does not grade)."""

    async def step(self, action: str) -> Any:
        result = await super().step(action)
        result.train_turn = self.steps != 1
        return result


async def test_an_env_can_make_a_model_turn_context(qwen3_tokenizer: Any) -> None:
    engine = ScriptedEngine(qwen3_tokenizer, ["first", "second", "third"])
    traj = await run(spec_for(engine, qwen3_tokenizer, lambda s: _ContextTurnEnv(s, done_after=3)))
    first, second, third = [t for t in traj.turns if t.role == "assistant"]
    assert traj.num_turns == 3 and traj.loss_mask[first.start : first.end] == [0] * (first.end - first.start)
    assert traj.rollout_logprobs[first.start : first.end] == [0.0] * (first.end - first.start)
    assert all(traj.loss_mask[t.start : t.end] == [1] * (t.end - t.start) for t in (second, third))
    assert traj.metrics["tokens/env_masked"] == first.end - first.start
    assert traj.metrics["check/ok"] is True  # the same tokens: only what is trained on changed


async def test_inference_contexts_record_what_a_chat_server_would_render(qwen3_tokenizer: Any) -> None:
    """Qwen3's template drops earlier turns' reasoning when it renders history: with inference
    contexts on, each later model turn records that render (what a chat server would have fed the
    model), while the trajectory itself stays the exact sequence the engine conditioned on."""
    replies = ["<think>\nFirst thought.\n</think>\n\n12", "<think>\nSecond thought.\n</think>\n\n15", "14"]
    engine = ScriptedEngine(qwen3_tokenizer, replies)
    spec = spec_for(engine, qwen3_tokenizer, lambda s: EchoEnv(s, done_after=3))
    spec.inference_contexts = True
    traj = await run(spec)
    first, second, third = [t for t in traj.turns if t.role == "assistant"]
    assert first.context_ids is None  # the prompt: the same render
    for turn, kept in ((second, "12"), (third, "15")):
        assert turn.context_ids is not None
        text = qwen3_tokenizer.decode(turn.context_ids)
        assert "thought" not in text and kept in text and text.endswith("<|im_start|>assistant\n")
    assert "First thought" in qwen3_tokenizer.decode(engine.prompts[1])  # the engine saw the exact one
    assert traj.metrics["inference/rewritten_turns"] == 2
    plain = await run(spec_for(ScriptedEngine(qwen3_tokenizer, ["1", "2"]), qwen3_tokenizer, tool_env))
    assert all(t.context_ids is None for t in plain.turns)  # off by default


class PenaltyEnv(EchoEnv):
    """A per-turn penalty of 0.05: the fewer turns, the better; remembers what it was given."""

    async def step(self, action: str) -> Any:
        self.given = [*getattr(self, "given", []), action]
        result = await super().step(action)
        result.reward = -0.05
        return result


async def test_a_turn_cut_at_max_tokens_has_its_turn_reward(qwen3_tokenizer: Any) -> None:
    """Off (default): the cut turn ends the trajectory unstepped with a 0.0 entry (one per model
    turn); with ``limits.step_cut_turns`` the env is given the cut turn, so its penalty applies."""
    envs: list[PenaltyEnv] = []

    def make(sample: Sample) -> PenaltyEnv:
        envs.append(PenaltyEnv(sample))
        return envs[-1]

    rambling = ScriptedReply(text="and so on " * 40, finish_reason="length")
    for stepped, expected in ((False, [-0.05, 0.0]), (True, [-0.05, -0.05])):
        engine = ScriptedEngine(qwen3_tokenizer, ["Short.", rambling])
        traj = await run(spec_for(engine, qwen3_tokenizer, make, max_tokens=16, step_cut_turns=stepped))
        assert traj.stop_reason == StopReason.LENGTH and traj.num_turns == 2
        assert (
            traj.turn_rewards == expected
            and [t.reward for t in traj.turns if t.role == "assistant"] == expected
        )
        assert len(envs[-1].given) == (2 if stepped else 1)
        assert_record_consistent(traj)
