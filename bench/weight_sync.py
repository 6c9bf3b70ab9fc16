"""Weights into a vLLM server: a collective (gloo, bucketed broadcast to its workers) against a file
(safetensors in shared memory, then the server's reload), side by side on one server.

What ``turnrl train`` does after every step on vLLM servers (``engine.weight_sync``). For each model,
one server turnrl starts (float32), two clients of it: each round perturbs every weight, pushes
the same weights by file and then by collective (``VLLMServerEngine.update_weights``: pause, load,
tied-layer refresh, prefix-cache reset, version, resume), and after each push generates the same
prompt greedily: the tokens must be equal either way. Reported: the median push of each, and the
ratio. The first round warms both up (the group is joined there) and is not counted.

    .venv/bin/python bench/weight_sync.py [--pushes 3] [--models smollm2-135m,qwen3-0.6b]

``qwen3-0.6b``: a random-init Qwen3 in Qwen3-0.6B's shape (596M parameters, bench/gpu_check.py's),
built into a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from turnrl.app.engines import vllm_engine
from turnrl.config import VLLMEngineConfig
from turnrl.engines.vllm import VLLMServerEngine
from turnrl.models import load_model, load_tokenizer
from turnrl.types import SamplingParams


def model_folder(name: str, scratch: Path) -> str:
    if name != "qwen3-0.6b":
        return name
    from gpu_check import build_model

    return str(build_model(scratch / "qwen3-0.6b-shape"))


async def bench_model(name: str, pushes: int, scratch: Path) -> tuple[float, float]:
    model_name = model_folder(name, scratch)
    tokenizer = load_tokenizer(model_name)
    model = load_model(model_name).float()
    config = VLLMEngineConfig(kind="vllm", servers=1, max_model_len=1024, kv_cache_gib=1, weight_sync="file")
    print(
        f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; starting vLLM",
        flush=True,
    )
    managed: Any = vllm_engine(model_name, config, tokenizer, log_dir=scratch / f"logs-{name}")
    url = managed.servers[0].url
    eos = [tokenizer.eos_token_id]
    clients = {
        sync: VLLMServerEngine(
            url, eos_token_ids=eos, refresh_tied_weights=True, weight_sync=sync, timeout_s=600
        )
        for sync in ("file", "collective")
    }
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the sea."}], add_generation_prompt=True, return_dict=False
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    times: dict[str, list[float]] = {sync: [] for sync in clients}
    try:
        for i in range(pushes + 1):
            with torch.no_grad():  # every weight changes (the tied output layer with its embedding)
                for param in model.parameters():
                    param.mul_(1.0 + 1e-3 * (1 if i % 2 else -1))
            tokens = {}
            for sync, client in clients.items():
                t0 = time.perf_counter()
                await client.update_weights(model.state_dict())
                took = time.perf_counter() - t0
                tokens[sync] = (await client.generate(prompt, greedy)).token_ids
                if i:
                    times[sync].append(took)
                print(f"{name} push {i} by {sync}: {took:.3f} s", flush=True)
            if tokens["file"] != tokens["collective"]:
                raise SystemExit(
                    f"{name}: the tokens differ after the same weights by file and by collective"
                )
    finally:
        for client in clients.values():
            await client.close()
        await managed.close()
    file, collective = (statistics.median(times[s]) for s in ("file", "collective"))
    print(f"{name}: median push by file {file:.3f} s, by collective {collective:.3f} s")
    return file, collective


async def main(pushes: int, models: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="turnrl-bench-sync-") as scratch:
        rows = [(name, *await bench_model(name, pushes, Path(scratch))) for name in models]
    print("model | file (s) | collective (s) | collective against file | tokens")
    for name, file, collective in rows:
        print(f"{name} | {file:.3f} | {collective:.3f} | x{file / collective:.2f} | equal")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=3, help="pushes of each way counted, per model")
    parser.add_argument("--models", default="smollm2-135m,qwen3-0.6b")
    args = parser.parse_args()
    asyncio.run(main(args.pushes, args.models.split(",")))
