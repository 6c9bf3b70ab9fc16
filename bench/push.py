"""A weight push to a vLLM server: writing the weights file, then the server's reload, timed.

What ``turnrl train`` does after every step on vLLM servers: write the policy's state dict as one
safetensors file in shared memory, then ask the server to reload it (pause, reload, resume). Two
writers side by side, pushes alternating, on one server turnrl starts (SmolLM2-135M-Instruct,
float32, 540 MB), after ``scripts/install_vllm.sh``:
- in place (turnrl's ``save_weights``): the same file rewritten over the last push's pages;
- new file: ``safetensors.torch.save_file`` to a new file renamed over the old one (what turnrl
  did before), so every push faults in fresh shared-memory pages.

Each push writes new values (every weight perturbed in place, the tied output layer with its
embedding), so no push is a no-op. Reported: the median
write, reload and whole push of each writer, and their ratios.

    .venv/bin/python bench/push.py [--pushes 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from turnrl.app.engines import vllm_engine
from turnrl.config import VLLMEngineConfig
from turnrl.engines.vllm import WEIGHTS_FILE, save_weights, scratch_weights_dir, untied
from turnrl.models import load_model, load_tokenizer

MODEL = "smollm2-135m"


def save_new_file(weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """The former writer: ``safetensors`` to a new file, renamed over the last (tied tensors once)."""
    from safetensors.torch import save_file

    tmp = folder / f".{WEIGHTS_FILE}.tmp"
    save_file({name: tensor.contiguous() for name, tensor in untied(weights).items()}, str(tmp))
    os.replace(tmp, folder / WEIGHTS_FILE)
    return folder


async def push(engine: Any, writer: Any, weights: dict[str, Any], folder: Path) -> tuple[float, float]:
    """One push: (write seconds, reload seconds)."""
    t0 = time.perf_counter()
    await asyncio.to_thread(writer, weights, folder)
    t1 = time.perf_counter()
    await engine.update_weights(folder)
    return t1 - t0, time.perf_counter() - t1


async def main(pushes: int) -> None:
    model = load_model(MODEL)
    config = VLLMEngineConfig(kind="vllm", servers=1, max_model_len=1024, kv_cache_gib=1)
    folders = {"in place": scratch_weights_dir(), "new file": scratch_weights_dir()}
    writers = {"in place": save_weights, "new file": save_new_file}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in writers}
    print(f"starting vLLM for {MODEL}")
    managed = vllm_engine(MODEL, config, load_tokenizer(MODEL), log_dir=Path("runs/bench_push"))
    try:
        for i in range(pushes + 1):  # the first round warms both up and is not counted
            for name, writer in writers.items():
                with torch.no_grad():  # in place: the tied output layer stays the embedding
                    for param in model.parameters():
                        param.add_(1e-4)
                took = await push(managed, writer, model.state_dict(), folders[name])
                if i:
                    times[name].append(took)
                print(f"push {i} {name}: write {took[0]:.3f} s, reload {took[1]:.3f} s", flush=True)
    finally:
        await managed.close()
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
    medians = {}
    for name, rows in times.items():
        write, load = (statistics.median(r[k] for r in rows) for k in (0, 1))
        whole = statistics.median(r[0] + r[1] for r in rows)
        medians[name] = (write, load, whole)
        print(f"{name}: median write {write:.3f} s, reload {load:.3f} s, push {whole:.3f} s")
    (w0, _, p0), (w1, _, p1) = medians["new file"], medians["in place"]
    print(f"in place against new file: write x{w0 / w1:.2f}, whole push x{p0 / p1:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=6, help="pushes of each writer counted")
    asyncio.run(main(parser.parse_args().pushes))
