"""What the gateway's tests share: a recording engine, a gateway on a loopback port, the lookup
agent's tools and replies, and the exactness check."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from turnrl.chat.encoder import ChatEncoder
from turnrl.gateway import GatewayConfig
from turnrl.gateway.routes import make_app
from turnrl.gateway.server import Gateway
from turnrl.gateway.store import CallLog
from turnrl.tools.parsers import get_parser
from turnrl.types import Generation, SamplingParams, Trajectory

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The value stored under a key.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]
CALL = (
    "<think>\nI should look it up.\n</think>\n\n"
    '<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call>'
)
ANSWER = "<think>\nThe tool said 42.\n</think>\n\nThe value of alpha is 42."
START = [
    {"role": "system", "content": "You look things up with your tools."},
    {"role": "user", "content": "What is alpha?"},
]


class Recorder:
    """An engine that remembers what it was given and what it sampled (the exactness reference)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seen: list[tuple[list[int], list[int]]] = []
        self.images: list[int] = []  # how many images each call was given
        self.where: list[str] = []  # the session/branch of each call

    async def generate(
        self, prompt_ids: Any, sampling: SamplingParams, images: Any = (), *, session: Any = None
    ) -> Generation:
        gen = await self.engine.generate(prompt_ids, sampling, images, session=session)
        self.seen.append((list(prompt_ids), list(gen.token_ids)))
        self.images.append(len(images))
        self.where.append(str(session))
        return gen

    @property
    def weight_version(self) -> int:
        return int(getattr(self.engine, "weight_version", 0))

    async def close(self) -> None:
        await self.engine.close()


@contextlib.contextmanager
def serving(gateway: Gateway) -> Iterator[str]:
    """The gateway on a free loopback port, in a thread; its base URL."""
    with served(gateway) as (url, _):
        yield url


@contextlib.contextmanager
def served(gateway: Any, app: Any = None) -> Iterator[tuple[str, asyncio.AbstractEventLoop]]:
    """The gateway (``app``: its routes, default ``make_app(gateway)``) on a loopback port, served by
    a loop of this test's own: its URL and that loop."""
    app = app or make_app(gateway)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the gateway did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", loop
    finally:
        server.should_exit = True
        thread.join(10)
        loop.close()


class Timed(Recorder):
    """The recorder, with the moment each generation returned."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.ended: list[float] = []

    async def generate(
        self, prompt_ids: Any, sampling: SamplingParams, images: Any = (), *, session: Any = None
    ) -> Generation:
        gen = await super().generate(prompt_ids, sampling, images, session=session)
        self.ended.append(time.monotonic())
        return gen


def gateway_for(engine: Any, tokenizer: Any, tmp_path: Path, **config: Any) -> Gateway:
    cfg = GatewayConfig.model_validate({"model": "tiny-qwen3", "output_dir": str(tmp_path), **config})
    return Gateway(Recorder(engine), ChatEncoder(tokenizer), get_parser("hermes"), cfg, CallLog(tmp_path))


def assert_exact(traj: Trajectory, seen: list[tuple[list[int], list[int]]]) -> None:
    """Every call the engine answered on this branch: its prompt is the branch's tokens up to there,
    and what it sampled follows them exactly, with mask 1 (the rest mask 0)."""
    ids = traj.input_ids
    model = [i for i, m in enumerate(traj.loss_mask) if m]
    covered: list[int] = []
    for prompt, sampled in seen:
        assert ids[: len(prompt)] == prompt
        assert ids[len(prompt) : len(prompt) + len(sampled)] == sampled
        covered += range(
            len(prompt) - len(traj.prompt_ids), len(prompt) - len(traj.prompt_ids) + len(sampled)
        )
    assert covered == model


def calls_on(gateway: Gateway, name: str, index: int) -> list[int]:
    """The engine calls (indexes into ``Recorder.seen``) whose tokens branch ``index`` of session
    ``name`` holds: its own, after those of its parent up to the point it forked at."""
    engine: Recorder = gateway.engine  # type: ignore[assignment]
    branch = gateway.sessions[name].branches[index]
    own = [k for k, where in enumerate(engine.where) if where == f"{name}/{index}"]
    if branch.fork_at is None or branch.parent is None:
        return own
    inherited = [
        k for k in calls_on(gateway, name, branch.parent)
        if len(engine.seen[k][0]) + len(engine.seen[k][1]) <= branch.fork_at
    ]  # fmt: skip
    return inherited + own
