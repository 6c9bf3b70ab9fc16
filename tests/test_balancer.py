"""BalancedEngine: least in flight, sticky sessions and their bounds, fail-over, cool-off."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.balancer import BalancedEngine
from turnrl.engines.http import RequestError, ServerError
from turnrl.engines.scripted import ScriptedEngine
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.testing import EchoEnv
from turnrl.types import EngineError, Generation, Limits, Sample, SamplingParams, StopReason

SAMPLING = SamplingParams(max_tokens=4)


class FakeEngine:
    """Answers at once (or when its gate opens), or raises ``fail``; records sessions."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.gate: asyncio.Event | None = None
        self.sessions: list[str | None] = []
        self.closed = False

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        self.sessions.append(session)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return Generation([7, 8], [-0.5, -0.25], "stop")

    async def close(self) -> None:
        self.closed = True


def balancer(*engines: FakeEngine, **kwargs: Any) -> BalancedEngine:
    return BalancedEngine(list(engines), names=[f"e{i}" for i in range(len(engines))], **kwargs)


async def where(bal: BalancedEngine, session: str | None = None) -> str:
    gen = await bal.generate([1, 2, 3], SAMPLING, session=session)
    assert gen.info is not None
    return str(gen.info["engine"])


async def test_new_requests_go_to_the_least_in_flight() -> None:
    e0, e1 = FakeEngine(), FakeEngine()
    e0.gate = asyncio.Event()
    bal = balancer(e0, e1)
    held = asyncio.create_task(bal.generate([1], SAMPLING, session="a"))
    await asyncio.sleep(0)
    assert bal.stats[0].in_flight == 1
    assert await where(bal, "b") == "e1"
    assert await where(bal) == "e1"  # no session: still the least loaded
    e0.gate.set()
    assert (await held).info == {"engine": "e0"}
    assert [s.in_flight for s in bal.stats] == [0, 0]


async def test_sessions_stick_until_the_engine_is_much_busier() -> None:
    e0, e1 = FakeEngine(), FakeEngine()
    bal = balancer(e0, e1, load_factor=2.0)
    assert await where(bal, "s") == "e0"
    assert await where(bal, "other") == "e1"  # e0 has served more
    assert await where(bal, "s") == "e0"  # sticky although e1 has served less
    e0.gate, e1.gate = asyncio.Event(), asyncio.Event()
    busy = [asyncio.create_task(bal.generate([1], SAMPLING, session=f"busy{i}")) for i in range(6)]
    await asyncio.sleep(0)
    assert bal.stats[0].in_flight == 3 and bal.stats[1].in_flight == 3  # placed by least in flight
    e1.gate.set()
    await asyncio.sleep(0)
    assert bal.stats[0].in_flight == 3 and bal.stats[1].in_flight == 0
    assert await where(bal, "s") == "e1"  # 3 > 2 x max(0, 1): the session moves
    assert await where(bal, "s") == "e1"  # and sticks to its new engine
    e0.gate.set()
    await asyncio.gather(*busy)


async def test_max_sticky_turns_lets_a_session_move() -> None:
    e0, e1 = FakeEngine(), FakeEngine()
    bal = balancer(e0, e1, max_sticky_turns=2)
    assert [await where(bal, "s") for _ in range(2)] == ["e0", "e0"]
    assert await where(bal, "s") == "e1"  # placed afresh: e1 has served less
    assert await where(bal, "s") == "e1"


@pytest.mark.parametrize("failure", [ServerError("unreachable"), ConnectionResetError("reset")])
async def test_a_failing_engine_is_marked_down_and_the_call_moves(failure: BaseException) -> None:
    e0, e1 = FakeEngine(fail=failure), FakeEngine()
    bal = balancer(e0, e1, cooloff_s=60)
    assert await where(bal, "s") == "e1"  # failed on e0, retried once on e1
    assert e0.sessions == ["s"] and e1.sessions == ["s"]
    assert bal.healthy() == [False, True] and bal.stats[0].failures == 1
    assert await where(bal, "t") == "e1"  # e0 gets nothing during its cool-off
    assert await where(bal, "s") == "e1"
    assert e0.sessions == ["s"]


async def test_the_engine_comes_back_after_its_cooloff() -> None:
    e0, e1 = FakeEngine(fail=ServerError("down")), FakeEngine()
    bal = balancer(e0, e1, cooloff_s=0.05)
    assert await where(bal, "s") == "e1"
    e0.fail = None
    await asyncio.sleep(0.06)
    assert bal.healthy() == [True, True]
    assert await where(bal, "new") == "e0"


async def test_a_bad_request_is_not_failed_over() -> None:
    e0, e1 = FakeEngine(fail=RequestError("HTTP 400: prompt too long")), FakeEngine()
    bal = balancer(e0, e1)
    with pytest.raises(RequestError, match="prompt too long"):
        await bal.generate([1], SAMPLING, session="s")
    assert e1.sessions == [] and bal.healthy() == [True, True]


async def test_no_healthy_engine_raises_engine_error() -> None:
    e0, e1 = FakeEngine(fail=ServerError("boom0")), FakeEngine(fail=ServerError("boom1"))
    bal = balancer(e0, e1, cooloff_s=60)
    with pytest.raises(EngineError, match="e0 failed: boom0; then e1 failed: boom1"):
        await bal.generate([1], SAMPLING)
    assert bal.healthy() == [False, False]
    with pytest.raises(EngineError, match="no healthy engine among 2"):
        await bal.generate([1], SAMPLING)


async def test_engines_without_a_session_keyword_work(qwen3_tokenizer: Any) -> None:
    scripted = ScriptedEngine(qwen3_tokenizer, ["Hello."] * 2)
    bal = BalancedEngine([scripted])
    gen = await bal.generate([1, 2], SAMPLING, session="s")
    assert gen.finish_reason == "stop" and gen.info is not None and gen.info["scripted"] is True
    await bal.close()
    with pytest.raises(EngineError, match="closed"):
        await scripted.generate([1], SAMPLING)


async def test_close_closes_every_engine() -> None:
    engines = [FakeEngine(), FakeEngine()]
    await BalancedEngine(engines).close()
    assert all(e.closed for e in engines)


async def test_the_loop_ends_with_engine_error_when_every_engine_is_down(qwen3_tokenizer: Any) -> None:
    bal = balancer(FakeEngine(fail=ServerError("down")), FakeEngine(fail=ServerError("down")))
    spec = RolloutSpec(
        env_factory=EchoEnv,
        engine=bal,
        encoder=ChatEncoder(qwen3_tokenizer),
        sampling=SAMPLING,
        limits=Limits(max_turns=3),
    )
    traj = await run_trajectory(Sample("s0", [{"role": "user", "content": "Hi"}]), spec)
    assert traj.stop_reason == StopReason.ENGINE_ERROR
    assert traj.error is not None and "failed" in traj.error


async def test_an_engine_added_while_running_takes_new_sessions() -> None:
    e0, e1 = FakeEngine(), FakeEngine()
    bal = balancer(e0)
    assert await where(bal, "s") == "e0"
    assert bal.add_engine(e1, "late") == 1
    assert await where(bal, "t") == "late"  # it has served the fewest
    assert await where(bal, "s") == "e0"  # a session already placed stays
    assert bal.healthy() == [True, True] and bal.active() == [0, 1]


async def test_a_retired_engine_gets_nothing_and_never_comes_back() -> None:
    e0, e1 = FakeEngine(), FakeEngine()
    bal = balancer(e0, e1, cooloff_s=0)
    assert await where(bal, "s") == "e0"
    assert bal.retire(0) is e0
    assert await where(bal, "s") == "e1"  # its session moved
    assert bal.healthy() == [False, True] and bal.active() == [1]
    assert await where(bal, "new") == "e1"
    assert e0.sessions == ["s"]
    bal.retire(1)
    with pytest.raises(EngineError, match="no healthy engine among 0"):
        await bal.generate([1], SAMPLING)
