"""Env code cannot hang, stall or kill a run: every call bounded, a blocking step moved to a thread,
SystemExit from env code one trajectory's env_error, non-finite rewards named and JSON kept strict."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.scripted import ScriptedEngine
from turnrl.env.base import Env
from turnrl.rollout import env_calls
from turnrl.rollout.collector import collect
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.rollout.metrics import summarize
from turnrl.types import Limits, Sample, SamplingParams, StepResult, StopReason

PROMPT = [{"role": "user", "content": "Go."}]


def spec(tokenizer: Any, env: Any, **limits: Any) -> RolloutSpec:
    return RolloutSpec(
        env_factory=env,
        engine=ScriptedEngine(tokenizer, ["step<|im_end|>"] * 64),
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=16),
        limits=Limits(**{"max_turns": 3, "env_timeout_s": 5.0, **limits}),
    )


def samples(n: int) -> list[Sample]:
    return [Sample(f"s{i}", PROMPT) for i in range(n)]


class SleepyStep(Env):
    """``async def step`` that blocks its thread with ``time.sleep`` (a sync call inside async)."""

    seconds = 1.2
    active = 0
    most = 0
    lock = threading.Lock()

    async def step(self, action: str) -> StepResult:
        cls = type(self)
        with cls.lock:
            cls.active += 1
            cls.most = max(cls.most, cls.active)
        time.sleep(cls.seconds)
        with cls.lock:
            cls.active -= 1
        return StepResult("ok", reward=1.0, done=self.sample.id.endswith("9"))


class SleepyStepTwo(SleepyStep):
    seconds = 2.0


async def test_a_blocking_step_is_detected_and_moved_to_threads_so_it_never_serializes_the_run(
    qwen3_tokenizer: Any,
) -> None:
    t0 = time.perf_counter()
    trajs = await collect(samples(8), spec(qwen3_tokenizer, SleepyStep, max_turns=3), concurrency=8)
    wall = time.perf_counter() - t0
    assert [t.stop_reason for t in trajs] == [StopReason.MAX_TURNS] * 8
    assert env_calls.blocking(SleepyStep(samples(1)[0])) is not None  # detected and reported
    assert SleepyStep.most >= 2  # after the first, steps ran side by side in worker threads
    assert wall < 8 * 3 * SleepyStep.seconds  # serialized would be 28.8 s


async def test_a_blocking_step_past_the_timeout_fails_as_a_timeout(qwen3_tokenizer: Any) -> None:
    limits = {"env_timeout_s": 1.5, "max_env_retries_per_turn": 1}
    trajs = await collect(samples(3), spec(qwen3_tokenizer, SleepyStepTwo, **limits), concurrency=3)
    assert {t.stop_reason for t in trajs} == {StopReason.ENV_ERROR}
    first = trajs[0]
    assert first.error is not None and ("held the event loop" in first.error or "timed out" in first.error)
    assert "blocked_loop" in summarize(trajs)["env_failures/by_kind"] or any(
        "timeout" in t.error for t in trajs if t.error
    )


class HangingScore(Env):
    async def step(self, action: str) -> StepResult:
        return StepResult(None, reward=1.0, done=True)

    async def score(self, trajectory: Any) -> float:
        await asyncio.sleep(3600)
        return 1.0


async def test_a_hanging_score_is_bounded_by_the_env_timeout(qwen3_tokenizer: Any) -> None:
    t0 = time.perf_counter()
    traj = await run_trajectory(samples(1)[0], spec(qwen3_tokenizer, HangingScore, env_timeout_s=0.5))
    assert time.perf_counter() - t0 < 30
    assert traj.metrics["reward_error"] == "score timed out after 0.5s" and traj.reward == 0.0


class Exits(Env):
    async def step(self, action: str) -> StepResult:
        if self.sample.id == "s1":
            raise SystemExit(3)
        if self.sample.id == "s2":
            raise KeyboardInterrupt
        return StepResult(None, reward=1.0, done=True)


async def test_system_exit_or_keyboard_interrupt_from_env_code_ends_that_trajectory_only(
    qwen3_tokenizer: Any,
) -> None:
    trajs = await collect(samples(4), spec(qwen3_tokenizer, Exits, max_env_retries_per_turn=0), concurrency=4)
    by_id = {t.group_id: t for t in trajs}
    assert len(trajs) == 4
    assert by_id["s1"].stop_reason == by_id["s2"].stop_reason == StopReason.ENV_ERROR
    assert "SystemExit(3)" in (by_id["s1"].error or "") and "KeyboardInterrupt" in (by_id["s2"].error or "")
    assert by_id["s0"].stop_reason == by_id["s3"].stop_reason == StopReason.ENV_DONE


class NaNScore(Env):
    async def step(self, action: str) -> StepResult:
        return StepResult(None, reward=1.0, done=True)

    async def score(self, trajectory: Any) -> float:
        return float("nan") if self.sample.id == "s0" else float("inf") if self.sample.id == "s1" else 0.5


class NaNStep(Env):
    async def step(self, action: str) -> StepResult:
        return StepResult(None, reward=float("nan"), done=True)


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


async def test_non_finite_rewards_are_env_errors_that_name_the_value_and_json_stays_strict(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    out = tmp_path / "trajectories.jsonl"
    trajs = await collect(samples(3), spec(qwen3_tokenizer, NaNScore), out_path=out)
    by_id = {t.group_id: t for t in trajs}
    assert by_id["s0"].stop_reason == StopReason.ENV_ERROR and "nan" in (by_id["s0"].error or "")
    assert by_id["s1"].stop_reason == StopReason.ENV_ERROR and "inf" in (by_id["s1"].error or "")
    assert by_id["s2"].reward == 0.5 and by_id["s2"].stop_reason == StopReason.ENV_DONE
    records = [_strict(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and all(r["reward"] in (0.0, 0.5) for r in records)
    summary = summarize(trajs)
    assert summary["stop_reasons"]["env_error"] == 2
    json.dumps(summary, allow_nan=False)
    step = await run_trajectory(samples(1)[0], spec(qwen3_tokenizer, NaNStep, max_env_retries_per_turn=0))
    assert step.stop_reason == StopReason.ENV_ERROR and "reward nan" in (step.error or "")


def test_the_timed_await_passes_results_errors_and_cancellation_through() -> None:
    async def fine() -> int:
        await asyncio.sleep(0)
        return 7

    async def raises() -> None:
        await asyncio.sleep(0)
        raise ValueError("boom")

    async def main() -> None:
        env = object()
        assert await env_calls.call(env, "step", fine, 1.0) == 7
        with pytest.raises(ValueError, match="boom"):
            await env_calls.call(env, "step", raises, 1.0)
        with pytest.raises(TimeoutError):
            await env_calls.call(env, "step", lambda: asyncio.sleep(10), 0.05)
        assert env_calls.blocking(env) is None

    asyncio.run(main())


@pytest.mark.parametrize("where", ["this loop", "a worker thread"])
def test_a_cancelled_env_call_is_never_finished_as_if_nothing_happened(where: str) -> None:
    """A stop (Ctrl-C, SIGTERM, a group stopped early) cancels each trajectory's task. A cancel that
    lands as the env's call finishes must still end the task: swallowed (as Python 3.11's
    ``asyncio.wait_for`` does when its inner call is already done), the trajectory went on to its
    next model turn and the stop waited on a request nobody wanted."""

    class Instant:
        async def step(self) -> int:
            return 7

    env = Instant()
    if where == "a worker thread":
        env_calls._blocking[Instant] = "made so by the test"

    async def cancelled_after(ticks: int) -> bool:
        """Whether a cancel after ``ticks`` loop turns, if the task took it, ended the task."""
        task = asyncio.create_task(env_calls.call(env, "step", env.step, 5.0))
        for _ in range(ticks):
            await asyncio.sleep(0)
        if not task.cancel():
            return True  # already done: nothing was cancelled
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    async def main() -> list[int]:
        return [ticks for ticks in range(12) if not await cancelled_after(ticks)]

    try:
        assert asyncio.run(main()) == []
    finally:
        env_calls.release(env)
        env_calls._blocking.pop(Instant, None)
