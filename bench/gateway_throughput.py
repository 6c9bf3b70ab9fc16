"""The gateway's throughput with many concurrent sessions, against the same calls sent to the engine
directly (goal: ≥0.95×).

The engine serves a random-init tiny Qwen3 (``tiny-qwen3``): turnrl's embedded one, or with
``--engine vllm`` a vLLM server that turnrl starts (scripts/install_vllm.sh), in its own processes,
driven through turnrl's vLLM client on both sides. Each session is a chat of ``--turns`` calls: a
user message, the reply, another user message, and so on.
- gateway: ``--sessions`` agents, each an ``openai.AsyncOpenAI`` client with its own API key (its
  own session), run in a separate process and call the gateway on loopback concurrently;
- direct: the token prompts the gateway sent to the engine, with the same sampling (seeds
  included), replayed by as many concurrent tasks, each calling ``engine.generate`` in its
  session's order, with a session name of its own (turnrl's rollout names its sessions too, and the
  engine keeps a session's KV between its turns).
Throughput is sampled tokens per wall second; the two alternate, ``--repeats`` times each, and the
ratio is of medians.

    .venv/bin/python bench/gateway_throughput.py [--engine hf|vllm] [--sessions 64] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from turnrl.app.engines import hf_engine, vllm_engine
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import VLLMEngineConfig
from turnrl.gateway import GatewayConfig
from turnrl.gateway.routes import make_app
from turnrl.gateway.server import Gateway
from turnrl.gateway.store import CallLog
from turnrl.models import load_tokenizer
from turnrl.types import Generation, SamplingParams


class Recording:
    """The engine, remembering each session's calls (prompt and sampling) in order."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: dict[str, list[tuple[list[int], SamplingParams, str]]] = {}

    async def generate(
        self, prompt_ids: Any, sampling: SamplingParams, images: Any = (), *, session: Any = None
    ) -> Generation:
        self.calls.setdefault(str(session).split("/")[0], []).append((list(prompt_ids), sampling, session))
        return await self.engine.generate(prompt_ids, sampling, images, session=session)

    async def close(self) -> None:
        return None


async def agents(url: str, sessions: int, turns: int, sdk: bool) -> dict[str, float]:
    """``sessions`` chat agents (on the OpenAI SDK, or plain httpx), concurrently; wall seconds and
    tokens sampled."""
    import httpx
    from openai import AsyncOpenAI

    async def call(
        k: int, messages: list[Any], http: httpx.AsyncClient, client: AsyncOpenAI | None
    ) -> tuple[Any, int]:
        if client is not None:
            reply = await client.chat.completions.create(model="tiny-qwen3", messages=messages)
            assert reply.usage is not None
            return reply.choices[0].message.model_dump(exclude_none=True), reply.usage.completion_tokens
        body = {"model": "tiny-qwen3", "messages": messages}
        answer = (await http.post(f"{url}/s/agent-{k}/v1/chat/completions", json=body)).json()
        return answer["choices"][0]["message"], answer["usage"]["completion_tokens"]

    async def agent(k: int, http: httpx.AsyncClient, client: AsyncOpenAI | None) -> int:
        messages: list[Any] = [{"role": "user", "content": f"Tell me about the number {k}."}]
        tokens = 0
        for turn in range(turns):
            message, sampled = await call(k, messages, http, client)
            tokens += sampled
            messages += [message, {"role": "user", "content": f"Go on ({turn})."}]
        return tokens

    limits = httpx.Limits(max_connections=sessions)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        # an agent makes its client once, before its calls (the SDK's costs ~45 ms of CPU: an SSL
        # context of its own), so the clients are made before the clock starts
        clients = [
            AsyncOpenAI(base_url=f"{url}/v1", api_key=f"agent-{k}", max_retries=0) if sdk else None
            for k in range(sessions)
        ]
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(agent(k, http, clients[k]) for k in range(sessions)))
        seconds = time.perf_counter() - t0
        for client in clients:
            if client is not None:
                await client.close()
        return {"seconds": seconds, "tokens": sum(tokens)}


def through_gateway(
    engine: Any, tokenizer: Any, args: argparse.Namespace, out: Path
) -> tuple[dict[str, float], Recording]:
    recording = Recording(engine)
    sampling = {"max_tokens": args.max_tokens, "stop_token_ids": list(range(0, 151000, 61))}
    config = GatewayConfig.model_validate(
        {"model": "tiny-qwen3", "output_dir": str(out), "sampling": sampling}
    )
    gateway = Gateway(recording, ChatEncoder(tokenizer), None, config, CallLog(out))  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(make_app(gateway), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        command = [
            sys.executable,
            __file__,
            "--client",
            url,
            "--sessions",
            str(args.sessions),
            "--turns",
            str(args.turns),
        ]
        command += ["--sdk"] if args.sdk else []
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    finally:
        server.should_exit = True
        thread.join(10)
        assert gateway.log is not None
        gateway.log.close()
    return result, recording


def direct(engine: Any, recording: Recording) -> dict[str, float]:
    """The recorded calls, replayed on the engine: one task per session, its calls in order, named by
    its session as turnrl's rollout names them (so the engine keeps a session's KV between its turns
    on both sides)."""

    async def session(calls: list[tuple[list[int], SamplingParams, str]]) -> int:
        tokens = 0
        for prompt, sampling, name in calls:
            tokens += len((await engine.generate(prompt, sampling, session=f"direct:{name}")).token_ids)
        return tokens

    async def run() -> dict[str, float]:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(session(calls) for calls in recording.calls.values()))
        return {"seconds": time.perf_counter() - t0, "tokens": sum(tokens)}

    return engine_loop.run(run())  # type: ignore[no-any-return]


engine_loop: asyncio.Runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sdk", action="store_true", help="agents on the openai SDK (default: plain httpx)")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(agents(args.client, args.sessions, args.turns, args.sdk))))
        return
    global engine_loop
    rows: dict[str, list[dict[str, float]]] = {"gateway": [], "direct": []}
    tokenizer = load_tokenizer("tiny-qwen3")
    server: Any = None
    if args.engine == "vllm":
        config = VLLMEngineConfig(kind="vllm", max_model_len=4096, kv_cache_gib=2)
        print("starting a vLLM server ...", file=sys.stderr)
        server = vllm_engine("tiny-qwen3", config, tokenizer, say=None, seed=0)
        url = server.servers[0].url

        def engine() -> Any:  # a client of its own per side and run: each runs in an event loop of its own
            return vllm_engine("tiny-qwen3", VLLMEngineConfig(kind="vllm", urls=[url]), tokenizer)

    else:
        embedded = hf_engine("tiny-qwen3", seed=0)

        def engine() -> Any:
            return embedded

    try:
        with tempfile.TemporaryDirectory() as tmp, asyncio.Runner() as engine_loop:
            through_gateway(engine(), tokenizer, args, Path(tmp) / "warm-up")  # first batches, imports
            for r in range(args.repeats):
                result, recording = through_gateway(engine(), tokenizer, args, Path(tmp) / f"run-{r}")
                rows["gateway"].append(result)
                rows["direct"].append(direct(engine(), recording))
    finally:
        if server is not None:
            asyncio.run(server.close())
    where = "tiny-qwen3 on " + ("a vLLM server (CPU build)" if server is not None else "the embedded engine")
    print(f"{args.sessions} sessions x {args.turns} calls, max_tokens {args.max_tokens}, {where}")
    print(f"{'path':<10}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    rates = {}
    for name, runs in rows.items():
        rate = statistics.median(run["tokens"] / run["seconds"] for run in runs)
        rates[name] = rate
        tokens = statistics.median(run["tokens"] for run in runs)
        seconds = statistics.median(run["seconds"] for run in runs)
        print(f"{name:<10}{tokens:>10.0f}{seconds:>10.2f}{rate:>12.1f}")
    print(
        f"gateway / direct throughput: {rates['gateway'] / rates['direct']:.3f}x (median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
