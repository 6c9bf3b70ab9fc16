"""Generation speed of the embedded engine against transformers ``generate`` and vLLM's CPU build.

The workload of the engine issue: N concurrent requests (chat prompts of SmolLM2-135M-Instruct,
float32), each sampling exactly T tokens at temperature 1 (no stop at eos, so every side does
the same work). Sides, one after the other in one run, each repeated:

- ``generate``: transformers ``model.generate`` on the whole batch at once (left-padded,
  ``do_sample``, ``min_new_tokens = max_new_tokens = T``): the batch-synchronous baseline.
- ``embedded, plain``: the embedded engine with ``packed_weights=False`` (``F.linear``).
- ``embedded``: the embedded engine as it ships (oneDNN-packed linear layers on CPU).
- ``vLLM`` (``--vllm``): one vLLM server that turnrl starts from ``scripts/install_vllm.sh``'s
  environment, sent the same token-id prompts with ``ignore_eos``, all at once.

``--device cuda`` runs ``generate`` and the engine on the GPU (``--dtype`` both; the packed
side is CPU-only and left out there): ``embedded`` replays its decode steps from CUDA graphs,
``embedded, eager`` runs them without (``cuda_graphs: false``). ``--json`` ends with one JSON line
of the medians.

    .venv/bin/python bench/engine_speed.py [--requests 32] [--tokens 128] [--repeats 3] [--vllm]
        [--model smollm2-135m] [--device cpu] [--dtype float32] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import torch

from turnrl.app import hf_engine
from turnrl.config import HFEngineConfig
from turnrl.models import load_model, load_tokenizer
from turnrl.types import SamplingParams

TOLERANCE = 0.05  # bfloat16 logits: a logprob gap larger than this is not rounding


def prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """Chat prompts of slightly different lengths."""
    out = []
    for i in range(count):
        messages = [
            {"role": "user", "content": f"Tell story {i}, about " + "a long road and " * (i % 5) + "a cat."}
        ]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append(list(ids))
    return out


async def generate_side(model: Any, tokenizer: Any, batch: list[list[int]], tokens: int) -> int:
    """transformers ``generate`` over the left-padded batch; the tokens generated."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    torch.manual_seed(0)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=pad,
        )
    if out.is_cuda:
        torch.cuda.synchronize()
    return int(out[:, width:].numel())


async def engine_side(engine: Any, batch: list[list[int]], tokens: int) -> int:
    """Every prompt sent at once to the embedded engine; the tokens generated."""
    gens = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(temperature=1.0, max_tokens=tokens, seed=i))
            for i, p in enumerate(batch)
        )
    )
    return sum(len(g.token_ids) for g in gens)


async def vllm_side(url: str, batch: list[list[int]], tokens: int) -> int:
    """Every prompt posted at once to vLLM as token ids; the tokens generated."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits, trust_env=False) as http:

        async def one(i: int, prompt: list[int]) -> int:
            body = {
                "prompt": prompt,
                "max_tokens": tokens,
                "temperature": 1.0,
                "seed": i,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
            }
            response = await http.post("/v1/completions", json=body)
            response.raise_for_status()
            return len(response.json()["choices"][0]["token_ids"])

        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch))))


async def graphs_exact(args: argparse.Namespace) -> None:
    """Greedy generations of the engine with its decode steps replayed from CUDA graphs against the
    same static steps run eagerly. cuBLAS may pick other kernels under capture, so a row may part
    where two tokens nearly tie: on the tokens both chose, the logprobs must agree, and where a
    row parts the two chosen tokens' logprobs must too (a near tie), within ``TOLERANCE``."""
    tokenizer = load_tokenizer(args.model)
    batch = prompts(tokenizer, args.requests)
    config = HFEngineConfig(device=args.device, dtype=args.dtype)
    opts: dict[str, Any] = {"eos_token_ids": [], "max_batch_size": args.requests}
    runs: dict[str, list[Any]] = {}
    for name in ("graphs", "static, eager", "plain"):
        engine = hf_engine(args.model, config, cuda_graphs=name != "plain", **opts)
        if name == "static, eager":
            engine._scheduler.graphs._capture = False  # type: ignore[union-attr]
        runs[name] = await asyncio.gather(
            *(engine.generate(p, SamplingParams(temperature=0.0, max_tokens=args.tokens)) for p in batch)
        )
        graphs = engine._scheduler.graphs
        if name == "graphs":
            assert graphs is not None and graphs.captured > 0, "no CUDA graph was captured"
        await engine.close()
    worst, same = 0.0, 0
    for a, b in zip(runs["graphs"], runs["static, eager"], strict=True):
        n = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
            len(a.token_ids),
        )
        same += n == len(a.token_ids)
        upto = min(n + 1, len(a.token_ids))  # the shared tokens, and the parting one
        worst = max([worst, *(abs(x - y) for x, y in zip(a.logprobs[:upto], b.logprobs[:upto], strict=True))])
    plain = sum(a.token_ids == b.token_ids for a, b in zip(runs["graphs"], runs["plain"], strict=True))
    print(
        f"graphs vs the same steps eager: {same}/{len(batch)} rows equal, largest logprob gap {worst:.4f} "
        f"(tolerance {TOLERANCE}); vs plain decode: {plain} rows equal"
    )
    print(json.dumps({"rows": len(batch), "equal_eager": same, "equal_plain": plain, "gap": worst}))
    if worst > TOLERANCE:
        raise SystemExit("CUDA graph replay differs from the same decode steps run eagerly")


async def main_async(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(args.model)
    batch = prompts(tokenizer, args.requests)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    no_stop: dict[str, Any] = {"eos_token_ids": [], "max_batch_size": args.requests}
    config = HFEngineConfig(device=args.device, dtype=args.dtype)
    packed = hf_engine(args.model, config, **no_stop)
    cpu = args.device == "cpu"
    other = {"packed_weights": False} if cpu else {"cuda_graphs": False}
    plain = hf_engine(args.model, config, **other, **no_stop)
    sides: dict[str, Callable[[], Awaitable[int]]] = {
        "generate": lambda: generate_side(model, tokenizer, batch, args.tokens)
    }
    sides["embedded, plain" if cpu else "embedded, eager"] = lambda: engine_side(plain, batch, args.tokens)
    sides["embedded"] = lambda: engine_side(packed, batch, args.tokens)
    vllm = None
    if args.vllm:
        from turnrl.app.engines import vllm_engine
        from turnrl.config import VLLMEngineConfig

        print("starting one vLLM server ...")
        vllm = vllm_engine(
            args.model, VLLMEngineConfig(kind="vllm", max_model_len=2048, kv_cache_gib=2), tokenizer
        )
        url = vllm.servers[0].url  # type: ignore[attr-defined]
        sides["vLLM"] = lambda: vllm_side(url, batch, args.tokens)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        if vllm is not None:  # warm-ups: a small call each
            await vllm_side(url, batch[:2], 4)
        await engine_side(packed, batch, 4)  # every bucket of the running batch (CUDA graphs)
        await engine_side(plain, batch[:2], 4)
        await generate_side(model, tokenizer, batch[:2], 4)
        for repeat in range(args.repeats):
            for name, side in sides.items():
                t0 = time.perf_counter()
                made = await side()
                seconds = time.perf_counter() - t0
                assert made == args.requests * args.tokens, f"{name} made {made} tokens"
                rates[name].append(made / seconds)
                rate = made / seconds
                print(f"  [{repeat + 1}] {name:<16} {made} tok, {seconds:6.2f}s, {rate:6.1f} tok/s")
    finally:
        await packed.close()
        await plain.close()
        if vllm is not None:
            await vllm.close()
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(f"{args.model}, {args.requests} requests x {args.tokens} tokens, median of {args.repeats} (tok/s):")
    for name, rate in med.items():
        print(f"  {name:<16} {rate:6.1f}")
    print(f"embedded / generate: {med['embedded'] / med['generate']:.2f}")
    if "embedded, plain" in med:
        print(f"embedded / embedded plain: {med['embedded'] / med['embedded, plain']:.2f}")
    if "embedded, eager" in med:
        print(f"embedded (CUDA graphs) / embedded eager: {med['embedded'] / med['embedded, eager']:.2f}")
    if "vLLM" in med:
        print(f"embedded / vLLM: {med['embedded'] / med['vLLM']:.2f}")
    if args.json:
        print(json.dumps(med))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm", action="store_true", help="add a vLLM server (scripts/install_vllm.sh)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the medians")
    parser.add_argument(
        "--graphs-exact", action="store_true", help="greedy tokens with CUDA graphs against without (GPU)"
    )
    args = parser.parse_args()
    asyncio.run(graphs_exact(args) if args.graphs_exact else main_async(args))


if __name__ == "__main__":
    main()
