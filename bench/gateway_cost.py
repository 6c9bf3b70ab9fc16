"""The gateway's own cost per call, as a session grows: everything but the engine.

An agent loop on the OpenAI chat format (a tool call each turn, its result appended) calls the
gateway over and over in one session; the engine answers at once with a pre-tokenized reply, so
what is timed is the gateway: reading the request, checking that its messages extend the branch
(by meaning), delta-encoding the new messages, recording the reply, parsing its tool call, and
appending the call to ``calls.jsonl`` (synced). Two ways, side by side:
- in process: ``Gateway.chat`` on the request body (no HTTP);
- over HTTP: the same requests posted to the server on loopback by an httpx client in a process of
  its own (as an agent is), minus the same engine time, as the server spends it (from the app's
  call to its reply's last byte: the gateway's own cost over HTTP) and as the client sees it (with
  the client's own encoding and decoding of a history that grows).

    .venv/bin/python bench/gateway_cost.py [--turns 10 100] [--repeats 3]
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

import httpx
import uvicorn
from transformers import AutoTokenizer

from turnrl.chat.encoder import ChatEncoder
from turnrl.gateway import GatewayConfig, openai_chat
from turnrl.gateway.routes import make_app
from turnrl.gateway.server import Gateway
from turnrl.gateway.store import CallLog
from turnrl.models import qwen3_tokenizer_dir
from turnrl.tools.parsers import get_parser
from turnrl.types import Generation, SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
REPLY = (
    "<think>\nI need the next number; calling the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23+4"}}\n</tool_call>'
)
RESULT = "395 (17*23+4). Keep going: the running total is now larger than before."
START = [
    {"role": "system", "content": "You are a careful assistant. Use the calculator."},
    {"role": "user", "content": "Add up the numbers the tool gives you, one call per turn."},
]


class InstantEngine:
    """Answers at once with the same pre-tokenized reply; sums the time spent inside it."""

    def __init__(self, reply_ids: list[int]) -> None:
        self.reply_ids = reply_ids
        self.inside = 0.0

    async def generate(
        self, prompt_ids: Any, sampling: SamplingParams, images: Any = (), *, session: Any = None
    ) -> Generation:
        t0 = time.perf_counter()
        ids = list(self.reply_ids)
        gen = Generation(ids, [-0.1] * len(ids), "stop")
        self.inside += time.perf_counter() - t0
        return gen

    async def close(self) -> None:
        return None


def make_gateway(tokenizer: Any, out: Path) -> tuple[Gateway, InstantEngine]:
    encoder = ChatEncoder(tokenizer)
    engine = InstantEngine([*encoder.template.encode(REPLY), tokenizer.convert_tokens_to_ids("<|im_end|>")])
    config = GatewayConfig(model="qwen3", output_dir=str(out), max_session_tokens=10**7)
    config = config.model_copy(update={"sampling": SamplingParams(max_tokens=10**6)})
    return Gateway(engine, encoder, get_parser("hermes"), config, CallLog(out)), engine


def next_messages(messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The agent's next request: the reply as the client re-serializes it, then the tool's result."""
    call = reply["tool_calls"][0]
    echoed = {"role": "assistant", "content": reply.get("content"), "tool_calls": [call]}
    return [*messages, echoed, {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]


def in_process(tokenizer: Any, turns: int, out: Path) -> list[float]:
    """Seconds of gateway work per call (engine time removed), for each call of one session."""
    gateway, engine = make_gateway(tokenizer, out)

    async def run() -> list[float]:
        costs = []
        messages: list[dict[str, Any]] = [dict(m) for m in START]
        for _ in range(turns):
            body = json.loads(json.dumps({"model": "qwen3", "messages": messages, "tools": TOOLS}))
            before, t0 = engine.inside, time.perf_counter()
            done = await gateway.answer("bench", openai_chat.read_request(body))
            costs.append(time.perf_counter() - t0 - (engine.inside - before))
            messages = next_messages(messages, openai_chat.response(done)["choices"][0]["message"])
        return costs

    try:
        return asyncio.run(run())
    finally:
        assert gateway.log is not None
        gateway.log.close()


class Timed:
    """An ASGI wrapper that times each request from the app's first call to its response's last byte
    sent: the server's side of a call (the gateway's own work over HTTP), without the client's."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seconds: list[float] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        t0 = time.perf_counter()

        async def timed(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self.seconds.append(time.perf_counter() - t0)

        await self.app(scope, receive, timed)


def over_http(tokenizer: Any, turns: int, out: Path) -> tuple[list[float], list[float]]:
    """Seconds per call as the server spends them and as an agent process sees them (an httpx
    client in a process of its own, as agents are); engine time removed from both."""
    gateway, engine = make_gateway(tokenizer, out)
    app = Timed(make_app(gateway))
    engine_times: list[float] = []
    answer = gateway.answer

    async def timed_answer(*args: Any, **kwargs: Any) -> Any:
        before = engine.inside
        try:
            return await answer(*args, **kwargs)
        finally:
            engine_times.append(engine.inside - before)

    gateway.answer = timed_answer  # type: ignore[method-assign]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/chat/completions"
    seen = out.parent / f"{out.name}.client.json"
    try:
        subprocess.run([sys.executable, __file__, "--client", url, str(turns), str(seen)], check=True)
    finally:
        server.should_exit = True
        thread.join(10)
    client = json.loads(seen.read_text())
    inside = [a - e for a, e in zip(app.seconds, engine_times, strict=True)]
    return [c - e for c, e in zip(client, engine_times, strict=True)], inside


def client_loop(url: str, turns: int, out: Path) -> None:
    """The agent's side of ``over_http``: one session's calls, each timed, written to ``out``."""
    costs = []
    with httpx.Client(headers={"Authorization": "Bearer bench"}) as client:
        messages: list[dict[str, Any]] = [dict(m) for m in START]
        for _ in range(turns):
            t0 = time.perf_counter()
            answer = client.post(url, json={"model": "qwen3", "messages": messages, "tools": TOOLS}).json()
            costs.append(time.perf_counter() - t0)
            messages = next_messages(messages, answer["choices"][0]["message"])
    out.write_text(json.dumps(costs))


def at_depth(costs: list[float], depth: int, window: int = 5) -> float:
    """Median cost of the calls just before ``depth`` (milliseconds)."""
    return statistics.median(costs[max(0, depth - window) : depth]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--client", nargs=3, metavar=("URL", "TURNS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_loop(args.client[0], int(args.client[1]), Path(args.client[2]))
        return
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    longest = max(args.turns)
    runs: dict[str, list[list[float]]] = {"in process": [], "HTTP, server": [], "HTTP, client": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            runs["in process"].append(in_process(tokenizer, longest + 1, Path(tmp) / f"in-{r}"))
            client, server = over_http(tokenizer, longest + 1, Path(tmp) / f"http-{r}")
            runs["HTTP, server"].append(server)
            runs["HTTP, client"].append(client)
    print(f"gateway cost per call (ms, median of {args.repeats} runs) at call N; engine time removed")
    print(f"{'method':<14}" + "".join(f"{n:>10}" for n in args.turns))
    for name, all_costs in runs.items():
        row = [statistics.median(at_depth(c, n) for c in all_costs) for n in args.turns]
        print(f"{name:<14}" + "".join(f"{v:>10.3f}" for v in row) + f"   flatness {row[-1] / row[0]:.2f}")


if __name__ == "__main__":
    main()
