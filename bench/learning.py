"""A learning gateway's serving while it learns, against the same gateway serving only; and the time
from a reward to weights that learned from it.

One process: the gateway (``--model``, default SmolLM2-135M-Instruct, on the embedded engine) with
its learner, and ``--sessions`` concurrent users on ``httpx`` that each send single-call sessions
back to back (not streamed, ``--max-tokens`` each). Two phases of ``--seconds`` each, alternating
``--repeats`` times: *serving only* and *learning*. In both, every session is rewarded right after its
reply by the demo's liking for short answers (which ends the session, as a user's reward does);
in *learning* a step starts every ``sessions_per_step`` sessions, in *serving only* the learner
drops them untrained and idles. Per phase: calls per second, sampled tokens per second, and
the latency of a call (p50, p99). Reward to weights: per step, from the post of the reward that
completed its batch to the moment the step's weights are served.

    .venv/bin/python bench/learning.py [--sessions 8] [--seconds 60] [--repeats 2] [--nice 19] [--lr 1e-9]
        [--swap between_calls|in_flight] [--learner thread|process]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from rich.console import Console

from turnrl.app.engines import hf_engine
from turnrl.app.learning import Learning, LearningGatewayConfig
from turnrl.chat.encoder import ChatEncoder
from turnrl.gateway.rewards import RewardDesk
from turnrl.gateway.routes import make_app
from turnrl.gateway.server import Gateway
from turnrl.gateway.store import CallLog
from turnrl.models import SMOLLM2_135M, load_tokenizer


def liking(answer: str, limit: int = 12) -> float:
    words = len(answer.split())
    return 1.0 if 0 < words <= limit else (0.0 if words == 0 else limit / words)


async def users(
    url: str, sessions: int, seconds: float, learn: bool, posted: dict[str, float]
) -> dict[str, Any]:
    """``sessions`` users for ``seconds``: their calls' latencies and tokens (``learn``: the phase,
    in the sessions' names)."""
    latencies: list[float] = []
    tokens = [0]
    until = time.monotonic() + seconds

    async def user(k: int, http: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() < until:
            name = f"{'learn' if learn else 'serve'}-{k}-{n}-{time.monotonic_ns()}"
            n += 1
            body = {"model": "m", "messages": [{"role": "user", "content": f"Name a colour ({n})."}]}
            t0 = time.perf_counter()
            answer = (await http.post(f"{url}/s/{name}/v1/chat/completions", json=body)).json()
            latencies.append(time.perf_counter() - t0)
            tokens[0] += answer["usage"]["completion_tokens"]
            # both phases: a session ends with its reward (serving only: the learner drops it)
            reward = liking(answer["choices"][0]["message"]["content"] or "")
            posted[name] = time.monotonic()
            rewarded = await http.post(f"{url}/v1/rewards", json={"session": name, "reward": reward})
            rewarded.raise_for_status()

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=sessions * 2)) as http:
        await asyncio.gather(*(user(k, http) for k in range(sessions)))
    wall = time.perf_counter() - t0
    latencies.sort()
    return {
        "calls/s": len(latencies) / wall,
        "tokens/s": tokens[0] / wall,
        "p50": latencies[len(latencies) // 2],
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=SMOLLM2_135M)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    same = "the default does a step's whole work and leaves the answers as they were"
    parser.add_argument("--lr", type=float, default=1e-9, help=f"the learner's rate: {same}")
    parser.add_argument("--nice", type=int, default=19, help="learn.nice")
    parser.add_argument("--swap", choices=["between_calls", "in_flight"], default="between_calls")
    parser.add_argument("--learner", choices=["thread", "process"], default="process", help="learn.learner")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    config = LearningGatewayConfig.model_validate(
        {
            "model": args.model,
            "output_dir": tmp,
            "any_model": True,
            "sampling": {"max_tokens": args.max_tokens, "temperature": 1.0},
            "learn": {
                "sessions_per_step": 8,
                "optim": {"lr": args.lr},
                "train": {"save_every": 0},
                "nice": args.nice,
                "swap": args.swap,
                "learner": args.learner,
            },
        }
    )
    gateway = Gateway(
        hf_engine(args.model, seed=0),
        ChatEncoder(load_tokenizer(args.model)),
        None,
        config,
        CallLog(Path(tmp)),
    )
    desk = RewardDesk(gateway, Path(tmp) / "learn", config.learn.expire_s)
    learning = Learning(config, gateway, desk, Console(stderr=True, quiet=True))
    posted: dict[str, float] = {}
    served_at: list[tuple[float, list[str]]] = []  # when each step's weights were served, its sessions
    learn_step = learning.learn_step

    training = [False]  # serving only: the rewarded sessions are dropped, the learner idles

    async def timed_step() -> dict[str, float]:
        if not training[0]:
            desk.take(len(desk.ready))
            return {}
        learning._ready()  # the stale ones out first, as the step does
        names = [s[0].branch.session for s in desk.ready[: config.learn.sessions_per_step] if s[0].branch]
        version = int(gateway.engine.weight_version)  # type: ignore[attr-defined]
        out = await learn_step()
        if int(gateway.engine.weight_version) > version:  # type: ignore[attr-defined]
            served_at.append((time.monotonic(), names))
        return out

    learning.learn_step = timed_step  # type: ignore[method-assign]
    server = uvicorn.Server(
        uvicorn.Config(
            make_app(gateway, desk, [learning.metrics]), host="127.0.0.1", port=0, log_level="warning"
        )
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    asyncio.run_coroutine_threadsafe(learning.run(), loop)
    rows: dict[str, list[dict[str, Any]]] = {"serving only": [], "learning": []}
    asyncio.run(users(url, args.sessions, 10, False, posted))  # warm-up
    for _ in range(args.repeats):
        for phase in rows:
            training[0] = phase == "learning"
            rows[phase].append(
                asyncio.run(users(url, args.sessions, args.seconds, phase == "learning", posted))
            )
            print(f"{phase}: {rows[phase][-1]}", file=sys.stderr)
            while len(desk.ready) >= config.learn.sessions_per_step:  # the learner's queue, drained
                time.sleep(0.5)
            while learning._updating is not None and not learning._updating.done():  # its last update
                time.sleep(0.5)
    server.should_exit = True
    thread.join(30)
    counts = learning.counts
    print(
        f"model {args.model}, {args.sessions} concurrent sessions, max_tokens {args.max_tokens}, "
        f"{args.repeats} x {args.seconds:.0f} s per phase, lr {args.lr}, nice {args.nice}, swap {args.swap}, "
        f"learner {args.learner}; "
        f"steps {learning.step}, served {int(counts['served_steps'])}, stale sessions {int(counts['stale'])}"
    )
    print("| phase | calls/s | tokens/s | latency p50 (ms) | latency p99 (ms) |")
    print("|---|---:|---:|---:|---:|")
    medians = {}
    for phase, got in rows.items():
        medians[phase] = m = {k: statistics.median(r[k] for r in got) for k in got[0]}
        cells = [
            f"{m['calls/s']:.2f}",
            f"{m['tokens/s']:.1f}",
            f"{m['p50'] * 1e3:.0f}",
            f"{m['p99'] * 1e3:.0f}",
        ]
        print(f"| {phase} | {' | '.join(cells)} |")
    s, le = medians["serving only"], medians["learning"]
    ratio, tail = le["tokens/s"] / s["tokens/s"], le["p99"] / s["p99"]
    print(f"learning / serving only: throughput x{ratio:.2f}, p99 x{tail:.2f}")
    waits = [
        at - max(posted[n] for n in names)
        for at, names in served_at
        if names and all(n in posted for n in names)
    ]
    if waits:
        median, most = statistics.median(waits), max(waits)
        print(f"reward to served weights: median {median:.1f} s, max {most:.1f} s ({len(waits)} steps)")


if __name__ == "__main__":
    main()
