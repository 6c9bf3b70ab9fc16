"""Envs on Ray worker actors: same rollouts as local, a free driver loop, failures that end well."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from turnrl.chat.encoder import ChatEncoder  # noqa: E402
from turnrl.data import read_rows, to_samples  # noqa: E402
from turnrl.distributed import RayEnvConfig, RayEnvPool, ray_env_factory  # noqa: E402
from turnrl.distributed.worker import EnvSpec, EnvWorker  # noqa: E402
from turnrl.engines.scripted import ScriptedEngine  # noqa: E402
from turnrl.env.base import EnvFactory, StepResult  # noqa: E402
from turnrl.env.builtin.guess_number import GuessNumberEnv  # noqa: E402
from turnrl.env.registry import resolve_env  # noqa: E402
from turnrl.record.codec import trajectory_to_json  # noqa: E402
from turnrl.rollout.collector import collect, iter_trajectories  # noqa: E402
from turnrl.rollout.loop import RolloutSpec  # noqa: E402
from turnrl.testing import EchoEnv  # noqa: E402
from turnrl.types import (  # noqa: E402
    Limits,
    Sample,
    SamplingParams,
    StopReason,
    Trajectory,
)

# Envs defined here travel to the workers by value (this test module is not importable there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = Path(__file__).resolve().parents[1]
TOOLS_YAML = str(REPO / "examples" / "tools" / "calculator.yaml")
CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
REPLIES = [
    CALL.format("calculator", '{"expression": "37*41"}'),
    CALL.format("check_answer", '{"answer": "501"}'),
    "[7] <answer>1517</answer>",
    "[12]",
]


class SleepyEnv(EchoEnv):
    """Sleeps in every step: ``time.sleep`` (blocking, as sync code does) or ``asyncio.sleep``."""

    def __init__(self, sample: Sample, sleep_s: float = 0.2, blocking: bool = True, **kwargs: Any) -> None:
        super().__init__(sample, **kwargs)
        self.sleep_s = float(sample.metadata.get("sleep_s", sleep_s))
        self.blocking = blocking

    async def step(self, action: str) -> StepResult:
        """Sleep, then answer like EchoEnv."""
        if self.blocking:
            time.sleep(self.sleep_s)
        else:
            await asyncio.sleep(self.sleep_s)
        return await super().step(action)


def start_pool(workers: int = 2) -> RayEnvPool:
    pool = RayEnvPool(RayEnvConfig(enabled=True, num_workers=workers, num_cpus_per_worker=0.5))
    pool.ready()
    return pool


@pytest.fixture(scope="module")
def pool(ray_cluster: str) -> Iterator[RayEnvPool]:
    """Two env workers of half a CPU each."""
    pool = start_pool()
    yield pool
    pool.shutdown()


def spec_for(tokenizer: Any, env_factory: EnvFactory, **limits: Any) -> RolloutSpec:
    """A rollout whose model replies depend only on the turn, so any interleaving gives the same tokens."""

    def reply(prompt_ids: list[int], sampling: SamplingParams) -> str:
        turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return REPLIES[turn % len(REPLIES)]

    return RolloutSpec(
        env_factory=env_factory,
        engine=ScriptedEngine(tokenizer, reply),
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=64, seed=0),
        # The product's default bound: a healthy call on Ray, even on a loaded machine, never nears it.
        limits=Limits(**{"max_turns": 4, "env_timeout_s": 60.0, **limits}),
    )


def stories(count: int, **metadata: Any) -> list[Sample]:
    return [
        Sample(f"s{i}", [{"role": "user", "content": f"Story {i}."}], metadata=dict(metadata))
        for i in range(count)
    ]


def comparable(traj: Trajectory) -> dict[str, Any]:
    """Everything but timings."""
    out = trajectory_to_json(traj)
    out["turns"] = [{k: v for k, v in t.items() if k != "timings"} for t in out["turns"]]
    out["metrics"] = {k: v for k, v in out["metrics"].items() if not k.startswith("time/")}
    return out


CASES = [
    pytest.param("tool_env", {"tools_config": TOOLS_YAML}, "tools", {}, id="tool_env"),
    pytest.param("guess_number", {}, "guess", {}, id="guess_number-score"),
    pytest.param("turnrl.testing:FlakyEnv", {"failures": 1, "done_after": 2}, "stories", {}, id="retried"),
    pytest.param("turnrl.testing:FlakyEnv", {"failures": 5}, "stories", {}, id="env_error"),
    pytest.param(
        "turnrl.testing:FlakyEnv",
        {"failures": 1, "hang": True, "done_after": 1},
        "stories",
        # Each trajectory waits out one hung step. A loaded CI machine once took over 5 s for a healthy
        # open and reset on Ray (while a vLLM server held both cores), so the bound leaves room for it.
        {"env_timeout_s": 10.0},
        id="timeout-retried",
    ),
    pytest.param("turnrl.testing:BrokenResetEnv", {}, "stories", {}, id="reset_error"),
]


def samples_for(kind: str) -> list[Sample]:
    if kind == "tools":
        return to_samples(read_rows(str(REPO / "examples" / "data" / "tool_rows.jsonl")), "tools")
    if kind == "guess":
        return to_samples(GuessNumberEnv.dataset(size=3), "guess")
    return stories(3)


@pytest.mark.parametrize(("name", "kwargs", "data", "limits"), CASES)
async def test_rollouts_on_ray_equal_local(
    pool: RayEnvPool,
    qwen3_tokenizer: Any,
    name: str,
    kwargs: dict[str, Any],
    data: str,
    limits: dict[str, Any],
) -> None:
    samples = samples_for(data)
    remote = await collect(
        samples, spec_for(qwen3_tokenizer, pool.factory(name, kwargs), **limits), group_size=2
    )
    local_factory = resolve_env(name).bind(kwargs)
    local = await collect(samples, spec_for(qwen3_tokenizer, local_factory, **limits), group_size=2)
    assert len(remote) == len(local) == 2 * len(samples)
    by_id = {t.id: comparable(t) for t in local}
    for traj in remote:
        assert comparable(traj) == by_id[traj.id]
    assert pool.loads == [0, 0] and await pool.live_envs() == 0  # close always released every env


async def test_env_that_fails_to_build_ends_with_env_error(pool: RayEnvPool, qwen3_tokenizer: Any) -> None:
    factory = pool.factory("turnrl.testing:EchoEnv", {"bogus": 1})
    trajs = await collect(stories(2), spec_for(qwen3_tokenizer, factory))
    assert {t.stop_reason for t in trajs} == {StopReason.ENV_ERROR}
    assert all("TypeError" in (t.error or "") and "bogus" in (t.error or "") for t in trajs)
    assert pool.loads == [0, 0] and await pool.live_envs() == 0


async def test_env_errors_carry_the_original_message(pool: RayEnvPool, qwen3_tokenizer: Any) -> None:
    factory = pool.factory("turnrl.testing:FlakyEnv", {"failures": 5})
    [traj] = await collect(stories(1), spec_for(qwen3_tokenizer, factory, max_env_retries_per_turn=2))
    assert traj.stop_reason == StopReason.ENV_ERROR and traj.metrics["env_retries"] == 2
    assert traj.error == "step: env failed 3 times; last: ConnectionError: flaky env: attempt 3 failed"


async def test_remote_env_calls_run_in_the_worker(pool: RayEnvPool) -> None:
    sample = stories(1)[0]
    env = pool.factory(GuessNumberEnv, {"hi": 10})(sample)
    assert await env.reset() == sample.prompt and env.tools is None
    result = await env.step("[11]")
    assert env.format_observation(result.observation)[0]["content"].startswith("Invalid guess")
    assert env.format_observation("other") == [{"role": "user", "content": "other"}]  # the round-trip path
    assert await env.score(Trajectory("t", "t", "d", StopReason.ENV_DONE)) == 0.0
    assert sum(pool.loads) == 1 and await pool.live_envs() == 1
    await env.close()
    assert pool.loads == [0, 0] and await pool.live_envs() == 0


async def heartbeat_gap(run: Any) -> tuple[float, float]:
    """Run ``run()`` beside a 10 ms heartbeat; return (longest gap between beats, seconds taken)."""
    gaps: list[float] = []

    async def beat() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(beat())
    t0 = time.perf_counter()
    await run()
    seconds = time.perf_counter() - t0
    task.cancel()
    return max(gaps), seconds


@pytest.mark.alone
async def test_blocking_env_on_ray_does_not_block_the_driver(pool: RayEnvPool, qwen3_tokenizer: Any) -> None:
    samples = stories(4)
    kwargs: dict[str, Any] = {"sleep_s": 0.2, "done_after": 2}
    spec = spec_for(qwen3_tokenizer, lambda s: SleepyEnv(s, **kwargs))
    spec.encoder.conversation(None)  # probe the template now, not inside the timed runs

    async def rollouts(factory: EnvFactory) -> None:
        trajs = await collect(samples, dataclasses.replace(spec, env_factory=factory))
        assert [t.stop_reason for t in trajs] == [StopReason.ENV_DONE] * len(samples)

    local_gap, local_s = await heartbeat_gap(lambda: rollouts(spec.env_factory))
    on_ray = pool.factory(SleepyEnv, kwargs)
    await rollouts(pool.factory(SleepyEnv, {**kwargs, "sleep_s": 0.0}))  # warm up: the workers load the class
    ray_gap, ray_s = await heartbeat_gap(lambda: rollouts(on_ray))
    assert local_gap >= 0.2 and local_s >= 8 * 0.2  # in the driver, each sleep stalls everything
    assert ray_gap < 0.1  # on Ray the driver's loop keeps ticking
    assert ray_s < 4 * 0.2  # and the blocking steps overlap (one thread per env in the workers): ~2 x 0.2 s


@pytest.mark.alone
async def test_trajectories_stream_back_as_they_finish(pool: RayEnvPool, qwen3_tokenizer: Any) -> None:
    samples = [
        *stories(3, sleep_s=0.02),
        Sample("slow", [{"role": "user", "content": "Wait."}], metadata={"sleep_s": 1.0}),
    ]
    factory = pool.factory(SleepyEnv, {"blocking": False, "done_after": 1})
    t0 = time.perf_counter()
    arrivals = [
        (t.id, time.perf_counter() - t0)
        async for t in iter_trajectories(samples, spec_for(qwen3_tokenizer, factory))
    ]
    assert arrivals[-1][0] == "slow/0" and arrivals[-1][1] >= 1.0
    slow_at = arrivals[-1][1]
    assert all(
        seconds < slow_at - 0.5 for _, seconds in arrivals[:-1]
    )  # no barrier: fast ones come back first


async def test_killed_worker_ends_its_trajectories_and_is_replaced(
    ray_cluster: str, qwen3_tokenizer: Any
) -> None:
    pool = start_pool()
    try:
        factory = pool.factory(SleepyEnv, {"sleep_s": 0.3, "blocking": False, "done_after": 3})
        spec = spec_for(qwen3_tokenizer, factory)
        run = asyncio.create_task(collect(stories(6), spec))
        while await pool.live_envs() < 6:  # every env built and reset: they are stepping now
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        victim_load = pool.loads[0]
        ray.kill(pool.actors()[0])
        trajs = await asyncio.wait_for(run, 30)  # nothing hangs, every trajectory comes back
        assert len(trajs) == 6 and pool.replaced == 1
        failed = [t for t in trajs if t.stop_reason == StopReason.ENV_ERROR]
        assert len(failed) == victim_load == 3
        assert all("ActorDiedError" in (t.error or "") for t in failed)
        assert {t.stop_reason for t in trajs if t not in failed} == {StopReason.ENV_DONE}
        again = await asyncio.wait_for(collect(stories(6), spec), 30)  # the replacement serves new episodes
        assert {t.stop_reason for t in again} == {StopReason.ENV_DONE}
        assert pool.loads == [0, 0] and await pool.live_envs() == 0
    finally:
        pool.shutdown()


async def test_worker_closes_an_env_whose_open_was_abandoned() -> None:
    worker = EnvWorker(threads=True)
    spec = EnvSpec(SleepyEnv, {"blocking": True})
    opening = asyncio.create_task(worker.open("e1", spec, stories(1)[0]))
    await asyncio.sleep(0)
    await worker.close("e1")  # arrives while the env is being built
    with pytest.raises(RuntimeError, match="closed while it opened"):
        await opening
    assert worker.episodes == {}


async def test_ray_env_factory_runs_a_config_env(ray_cluster: str, qwen3_tokenizer: Any) -> None:
    config = RayEnvConfig(enabled=True, num_workers=1, num_cpus_per_worker=0.5)
    factory = ray_env_factory(resolve_env("guess_number").factory, {"hi": 8}, config)
    try:
        samples = to_samples(GuessNumberEnv.dataset(size=2, hi=8), "guess")
        trajs = await collect(samples, spec_for(qwen3_tokenizer, factory))
        assert len(trajs) == 2 and all(t.error is None for t in trajs)
    finally:
        factory.shutdown()


def test_pool_that_cannot_be_placed_fails_fast(ray_cluster: str) -> None:
    pool = RayEnvPool(RayEnvConfig(enabled=True, num_workers=1, num_cpus_per_worker=64))
    try:
        with pytest.raises(RuntimeError, match="ask for 64 CPUs, the cluster has 2"):
            pool.ready(timeout_s=0.5)
    finally:
        pool.shutdown()


def test_config_switch_defaults_off_and_rejects_unknown_keys() -> None:
    assert RayEnvConfig().enabled is False
    with pytest.raises(ValueError, match="extra"):
        RayEnvConfig.model_validate({"enabled": True, "workers": 3})


def test_importing_turnrl_does_not_import_ray() -> None:
    code = "import sys, turnrl, turnrl.distributed as d; d.RayEnvConfig; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
