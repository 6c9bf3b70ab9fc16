"""Rollout throughput against the engine driven directly, on the same multi-turn workload.

Both sides use the same embedded engine and model and run the same concurrent multi-turn
conversations: the same prompts, the same per-request seeds (so, since each request samples
with its own generator, the same tokens whatever the batch), and the same observations. The
engine-direct side is the least such a workload can cost: a bare loop that calls
``engine.generate`` and appends the observation ids. The rollout side is the full ``turnrl``
path (env step, decode, delta encoding, bookkeeping, the end-of-trajectory sanity check).
Both sides must generate the same number of tokens; the script checks it.

    .venv/bin/python bench/throughput.py [--model smollm2-135m] [--trajectories 32] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from turnrl.app import hf_engine
from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.hf import HFEngine
from turnrl.record.seeds import request_seed
from turnrl.rollout.collector import collect
from turnrl.rollout.loop import RolloutSpec
from turnrl.testing import EchoEnv
from turnrl.types import Limits, Sample, SamplingParams


def samples(count: int) -> list[Sample]:
    return [
        Sample(f"s{i}", [{"role": "user", "content": f"Tell story {i}, a sentence a turn."}])
        for i in range(count)
    ]


async def rollout_side(engine: HFEngine, tokenizer: Any, args: argparse.Namespace) -> tuple[int, float]:
    """(model tokens, seconds) for the full rollout path."""
    spec = RolloutSpec(
        env_factory=lambda s: EchoEnv(s),
        engine=engine,
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=args.tokens, seed=0),
        limits=Limits(max_turns=args.turns, max_context_tokens=8192),
    )
    t0 = time.perf_counter()
    trajs = await collect(samples(args.trajectories), spec, group_size=1, concurrency=args.trajectories)
    seconds = time.perf_counter() - t0
    return sum(sum(t.loss_mask) for t in trajs), seconds


async def engine_side(engine: HFEngine, tokenizer: Any, args: argparse.Namespace) -> tuple[int, float]:
    """(model tokens, seconds) for a bare loop on the engine with the same shape."""
    encoder = ChatEncoder(tokenizer).conversation(None)

    async def one(sample: Sample) -> int:
        seq = encoder.encode_prompt(sample.prompt)
        made = 0
        for turn in range(args.turns):
            sampling = SamplingParams(max_tokens=args.tokens, seed=request_seed(0, sample, 0, turn))
            gen = await engine.generate(seq, sampling, session=f"{sample.id}/0")  # as the rollout does
            made += len(gen.token_ids)
            if gen.finish_reason != "stop" or turn + 1 == args.turns:
                break
            last = tokenizer.decode(gen.token_ids[-1:])
            seq = seq + gen.token_ids
            seq += encoder.encode_observation(
                [{"role": "user", "content": f"Go on. (turn {turn + 1})"}], last
            )
        return made

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(s) for s in samples(args.trajectories)))
    return sum(counts), time.perf_counter() - t0


async def main_async(args: argparse.Namespace) -> None:
    engine = hf_engine(
        args.model, max_batch_size=args.trajectories, prefix_cache_tokens=args.prefix_cache_tokens
    )
    tokenizer = engine.tokenizer
    await engine_side(engine, tokenizer, argparse.Namespace(**{**vars(args), "trajectories": 4, "turns": 1}))
    counts: set[int] = set()
    rates: dict[str, list[float]] = {"engine": [], "rollout": []}
    for _ in range(args.repeats):
        for name, side in (("engine", engine_side), ("rollout", rollout_side)):
            tokens, seconds = await side(engine, tokenizer, args)
            counts.add(tokens)
            rates[name].append(tokens / seconds)
            print(f"  {name:<8} {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} tok/s")
    await engine.close()
    stats = engine.prefix_stats
    print(
        f"prompt tokens prefilled {stats['prefilled_tokens']}, reused from kept KV {stats['reused_tokens']}"
    )
    if len(counts) != 1:
        print(f"WARNING: the two sides generated different token counts: {sorted(counts)}")
    engine_rate, rollout_rate = (statistics.median(rates[k]) for k in ("engine", "rollout"))
    print(
        f"{args.model}: {args.trajectories} trajectories x {args.turns} turns x {args.tokens} tokens; "
        f"median of {args.repeats}: engine {engine_rate:.1f} tok/s, rollout {rollout_rate:.1f} tok/s, "
        f"ratio {rollout_rate / engine_rate:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-cache-tokens", type=int, default=32768, help="0: no KV kept between turns")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
