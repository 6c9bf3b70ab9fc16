"""vLLM, side by side: turnrl's rollout against the same requests sent to vLLM directly, vLLM against
the embedded engine on the same multi-turn workload, and the seconds a weight update takes.

One vLLM server (started by turnrl from vLLM's own environment, scripts/install_vllm.sh)
serves the model. The workload is bench/throughput.py's: concurrent multi-turn conversations
with the same prompts, per-request seeds and observations on every side.

- ``direct``: a bare loop that posts ``/v1/completions`` with the token ids (not streamed,
  the cheapest way to drive vLLM) and appends the observation ids itself;
- ``turnrl/vllm``: the full rollout path (env, delta encoding, sanity check) on turnrl's
  streaming vLLM client;
- ``turnrl/hf``: the same rollout on the embedded engine (both engines float32 on this CPU;
  vLLM's CPU build computes on every core, as turnrl starts it).

Every side must produce the same number of tokens (seeded requests); the script checks it.

    .venv/bin/python bench/vllm.py [--model smollm2-135m] [--trajectories 32] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx
from throughput import rollout_side, samples

from turnrl.app import hf_engine
from turnrl.app.engines import vllm_engine
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import VLLMEngineConfig
from turnrl.models import load_model, load_tokenizer
from turnrl.record.seeds import request_seed
from turnrl.types import Sample


async def direct_side(url: str, tokenizer: Any, args: argparse.Namespace) -> tuple[int, float]:
    """(model tokens, seconds) for a bare loop posting token ids to vLLM, not streamed."""
    encoder = ChatEncoder(tokenizer).conversation(None)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, trust_env=False) as http:

        async def one(sample: Sample) -> int:
            seq = encoder.encode_prompt(sample.prompt)
            made = 0
            for turn in range(args.turns):
                body = {
                    "prompt": seq,
                    "max_tokens": args.tokens,
                    "temperature": 1.0,
                    "seed": request_seed(0, sample, 0, turn),
                    "logprobs": 0,
                    "return_token_ids": True,
                    "skip_special_tokens": False,
                    "stop_token_ids": [tokenizer.eos_token_id],
                }
                choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
                ids = choice["token_ids"]
                made += len(ids)
                if choice["finish_reason"] != "stop" or turn + 1 == args.turns:
                    break
                seq = seq + ids
                observation = [{"role": "user", "content": f"Go on. (turn {turn + 1})"}]
                seq += encoder.encode_observation(observation, tokenizer.decode(ids[-1:]))
            return made

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(s) for s in samples(args.trajectories)))
    return sum(counts), time.perf_counter() - t0


async def weight_sync_seconds(engine: Any, model_name: str, repeats: int) -> list[float]:
    """Seconds per in-place weight update of the whole model (write, reload, cache reset)."""
    weights = load_model(model_name).state_dict()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await engine.update_weights(weights)
        seconds.append(time.perf_counter() - t0)
    return seconds


async def main_async(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(args.model)
    config = VLLMEngineConfig(kind="vllm", max_model_len=4096, kv_cache_gib=2)
    print("starting one vLLM server ...")
    vllm = vllm_engine(args.model, config, tokenizer, say=None)
    url = vllm.servers[0].url  # type: ignore[attr-defined]
    hf = hf_engine(args.model, max_batch_size=args.trajectories)
    sides = {
        "direct": lambda: direct_side(url, tokenizer, args),
        "turnrl/vllm": lambda: rollout_side(vllm, tokenizer, args),  # type: ignore[arg-type]
        "turnrl/hf": lambda: rollout_side(hf, tokenizer, args),
    }
    await direct_side(url, tokenizer, argparse.Namespace(**{**vars(args), "trajectories": 4, "turns": 1}))
    rates: dict[str, list[float]] = {name: [] for name in sides}
    counts: dict[str, set[int]] = {name: set() for name in sides}
    try:
        for _ in range(args.repeats):
            for name, side in sides.items():
                tokens, seconds = await side()
                counts[name].add(tokens)
                rates[name].append(tokens / seconds)
                print(f"  {name:<12} {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} tok/s")
        syncs = await weight_sync_seconds(vllm, args.model, 3)
    finally:
        await vllm.close()
        await hf.close()
    if len(counts["direct"] | counts["turnrl/vllm"]) != 1:
        print(f"WARNING: direct and turnrl/vllm generated different token counts: {counts}")
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(
        f"{args.model}: {args.trajectories} trajectories x {args.turns} turns x {args.tokens} tokens; "
        f"median of {args.repeats}: direct {med['direct']:.1f}, turnrl/vllm {med['turnrl/vllm']:.1f}, "
        f"turnrl/hf {med['turnrl/hf']:.1f} tok/s"
    )
    print(f"turnrl on vLLM / vLLM direct: {med['turnrl/vllm'] / med['direct']:.3f}")
    print(f"vLLM / embedded engine (both through turnrl): {med['turnrl/vllm'] / med['turnrl/hf']:.3f}")
    print(f"weight update (whole model, in place): {', '.join(f'{s:.2f}' for s in syncs)} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
