"""A simulated population of users of an agent served by a learning gateway.

Each user is an ``openai`` SDK client that asks short questions, reads the streamed answer and
rewards it by a liking of their own that the model is never told: each wants answers of at most
``limit`` words (8, 12 or 16: a reward of 1, less the more words past it). Every session's reward is
posted to the gateway (``POST /v1/rewards``, the user's name as the task, so each user has a
baseline of their own), which trains the model it serves on them while it goes on serving.

    python examples/learn/users.py [--minutes 5] [--users 8] [--set learn.learner=process]

starts ``turnrl gateway examples/learn/gateway.yaml`` (with each ``--set``; or uses ``--url``),
plays the users for ``--minutes``, prints the mean reward per minute, writes every session's reward to
``runs/learn/users.jsonl``, and stops the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI

HERE = Path(__file__).resolve().parent
QUESTIONS = [
    "What is the capital of France?", "Name a primary colour.", "What do bees make?",
    "How many legs does a spider have?", "What is water made of?", "Which planet is the largest?",
    "What is 7 times 6?", "What colour is the sky on a clear day?", "Who wrote Hamlet?",
    "What gas do plants take in?", "What is the boiling point of water in Celsius?",
    "Name a mammal that can fly.", "What is the opposite of hot?", "How many days are in a week?",
]  # fmt: skip
LIMITS = (8, 12, 16)


def liking(limit: int, answer: str) -> float:
    """A user's reward: 1 for an answer of at most ``limit`` words, less the longer it runs past."""
    words = len(answer.split())
    return 1.0 if 0 < words <= limit else (0.0 if words == 0 else limit / words)


async def user(name: str, limit: int, url: str, until: float, out: list[dict[str, object]]) -> None:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2)
    rng = random.Random(name)
    k = 0
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < until:
            session = f"{name}-{k}"
            k += 1
            stream = await client.chat.completions.create(
                model="smollm2-135m",
                messages=[{"role": "user", "content": rng.choice(QUESTIONS)}],
                stream=True,
                extra_headers={"Authorization": f"Bearer {session}"},  # the key names the session
            )
            answer = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            reward = liking(limit, answer)
            posted = await http.post(
                f"{url}/v1/rewards", json={"session": session, "reward": reward, "task": name}
            )
            posted.raise_for_status()
            out.append(
                {
                    "user": name,
                    "limit": limit,
                    "reward": reward,
                    "words": len(answer.split()),
                    "time": time.time(),
                }
            )
    await client.close()


def start_gateway(sets: list[str]) -> tuple[subprocess.Popen[str], str]:
    """``turnrl gateway examples/learn/gateway.yaml`` with ``sets`` (a fresh runs/learn); its process
    and URL."""
    config = [str(HERE / "gateway.yaml"), *(w for s in sets for w in ("--set", s))]
    command = [sys.executable, "-m", "turnrl.cli", "gateway", *config, "--overwrite"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "TERM": "dumb"})
    found: list[str] = []
    ready = threading.Event()

    def echo() -> None:  # the gateway's own lines (its learning steps), as they come
        assert process.stderr is not None
        for line in process.stderr:
            sys.stderr.write(line)
            if (m := re.search(r"at (http://\S+)/v1", line)) and not found:
                found.append(m.group(1))
                ready.set()

    threading.Thread(target=echo, daemon=True).start()
    if not ready.wait(600):
        process.kill()
        raise SystemExit("the gateway did not start")
    return process, found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--url", help="a learning gateway already running (default: start one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for the gateway")
    args = parser.parse_args()
    process, url = (None, args.url) if args.url else start_gateway(args.set)
    out: list[dict[str, object]] = []
    t0 = time.monotonic()
    try:
        until = t0 + args.minutes * 60
        players = [user(f"user{i}", LIMITS[i % len(LIMITS)], url, until, out) for i in range(args.users)]

        async def play() -> None:
            await asyncio.gather(*players)

        asyncio.run(play())
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    start = min(float(r["time"]) for r in out)  # type: ignore[arg-type]
    print("minute | sessions | mean reward | mean words")
    for minute in range(int(args.minutes + 0.999)):
        rows = [r for r in out if minute * 60 <= float(r["time"]) - start < (minute + 1) * 60]  # type: ignore[arg-type]
        if rows:
            mean = statistics.fmean(float(r["reward"]) for r in rows)  # type: ignore[arg-type]
            words = statistics.fmean(float(r["words"]) for r in rows)  # type: ignore[arg-type]
            print(f"{minute + 1:>6} | {len(rows):>8} | {mean:>11.3f} | {words:>10.1f}")
    folder = Path("runs/learn")
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "users.jsonl").open("w") as file:
        file.writelines(json.dumps(r) + "\n" for r in out)


if __name__ == "__main__":
    main()
