"""Time to the first token a client sees from the gateway: streamed as sampled, against the same
stream written out at the end (an engine that does not report tokens as it samples them: how every
capture gateway streams), and against a call not streamed.

The gateway serves ``--model`` (default SmolLM2-135M-Instruct, real weights) on the embedded engine.
Each round sends ``--concurrency`` single-call sessions at once, the same prompts and seeds in each
mode; a call's time to first token is from its request to the first content (a non-streamed call's
is its whole reply), and its total time is to the end of its reply. Modes alternate within each
repeat; medians over all calls of a mode.

    .venv/bin/python bench/streaming.py [--model smollm2-135m] [--concurrency 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from turnrl.app.engines import hf_engine
from turnrl.chat.encoder import ChatEncoder
from turnrl.gateway import GatewayConfig
from turnrl.gateway.routes import make_app
from turnrl.gateway.server import Gateway
from turnrl.models import SMOLLM2_135M, load_tokenizer
from turnrl.types import TOKEN_SINK, Generation, SamplingParams

MODES = ("streamed", "at the end", "not streamed")


class AtTheEnd:
    """The engine, with the tokens handed over only when the generation returns."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(
        self, prompt_ids: Any, sampling: SamplingParams, images: Any = (), *, session: Any = None
    ) -> Generation:
        TOKEN_SINK.set(None)  # this generation's task only
        return await self.engine.generate(prompt_ids, sampling, images, session=session)

    async def close(self) -> None:
        return None


async def call(
    http: httpx.AsyncClient, url: str, k: int, stream: bool, max_tokens: int
) -> tuple[float, float]:
    """One session's call: seconds to its first content, and to its end."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"Write a short story about the number {k}."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    t0 = time.perf_counter()
    first = None
    if not stream:
        (await http.post(f"{url}/s/bench-{k}/v1/chat/completions", json=body)).raise_for_status()
        end = time.perf_counter() - t0
        return end, end
    async with http.stream("POST", f"{url}/s/bench-{k}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return (first if first is not None else end), end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=SMOLLM2_135M)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine = hf_engine(args.model, seed=0)
    tokenizer = load_tokenizer(args.model)
    rows: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats + 1):  # the first round warms up
            for mode in MODES:
                served = AtTheEnd(engine) if mode == "at the end" else engine
                config = GatewayConfig.model_validate(
                    {
                        "model": "m",
                        "output_dir": str(Path(tmp) / f"{r}-{mode}"),
                        "any_model": True,
                        "sampling": {"max_tokens": args.max_tokens, "temperature": 1.0, "seed": r},
                    }
                )
                gateway = Gateway(served, ChatEncoder(tokenizer), None, config)  # type: ignore[arg-type]
                server = uvicorn.Server(
                    uvicorn.Config(make_app(gateway), host="127.0.0.1", port=0, log_level="warning")
                )
                thread = threading.Thread(target=server.run, daemon=True)
                thread.start()
                while not server.started:
                    time.sleep(0.01)
                url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

                async def round_(
                    url: str = url, stream: bool = mode != "not streamed"
                ) -> list[tuple[float, float]]:
                    async with httpx.AsyncClient(timeout=600) as http:
                        calls = (call(http, url, k, stream, args.max_tokens) for k in range(args.concurrency))
                        return list(await asyncio.gather(*calls))

                got = asyncio.run(round_())
                server.should_exit = True
                thread.join(10)
                if r:
                    rows[mode] += got
    print(f"model {args.model}, {args.concurrency} concurrent sessions, max_tokens {args.max_tokens}, "
          f"{args.repeats} repeats")  # fmt: skip
    print("| mode | time to first token, median (ms) | whole reply, median (ms) |")
    print("|---|---:|---:|")
    for mode in MODES:
        first = statistics.median(f for f, _ in rows[mode]) * 1000
        whole = statistics.median(e for _, e in rows[mode]) * 1000
        print(f"| {mode} | {first:.0f} | {whole:.0f} |")
    ratio = statistics.median(f for f, _ in rows["at the end"]) / statistics.median(
        f for f, _ in rows["streamed"]
    )
    print(f"time to first token, at the end / streamed: x{ratio:.1f}")


if __name__ == "__main__":
    main()
