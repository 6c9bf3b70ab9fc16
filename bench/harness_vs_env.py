"""An agent harness against the same task written as a turnrl ``Env`` (goal: ≥0.9× tokens/s).

The task is key lookup (``turnrl.env.builtin.key_lookup``): a tool call, the tool's answer, the
code. Both sides roll out the same prompts with the same engine (the embedded one), sampling and
group size, through ``turnrl.rollout.collector.collect``:
- env: ``KeyLookupEnv``, turn by turn in turnrl's loop;
- harness: ``examples/harness/lookup_agent.py`` (the plain openai SDK), one process per group
  member in its own folder and its own bubblewrap sandbox (the default), its calls served by the
  harness's gateway;
- bare: the same with ``env.sandbox: none`` (plain processes of the user);
- forked: the same unsandboxed with ``env.preload: [openai, "turnrl.harness.warm:openai"]``, each run
  forked from a process that imported the SDK once and made a client;
- sandboxed-forked: the same preload with the sandbox on (the fork server in a sandbox, each run
  in a sandbox of its own entered after the fork).
Throughput is sampled tokens per wall second (and trajectories per second); the two alternate,
``--repeats`` times each, and the ratio is of medians. Use a model that calls the tool (the
warm-started checkpoint of ``examples/harness/train_lookup.yaml``) for two-turn episodes. With
``--engine vllm`` a vLLM server that turnrl starts (scripts/install_vllm.sh) serves every side.

    .venv/bin/python bench/harness_vs_env.py [--model smollm2-135m] [--prompts 8] [--group 4]
        [--engine hf|vllm] [--sides env,harness,bare,forked,sandboxed-forked]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from turnrl.app.engines import hf_engine, vllm_engine
from turnrl.app.kinds import harness_gateway
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import HarnessConfig, VLLMEngineConfig
from turnrl.data import to_samples
from turnrl.env.builtin.key_lookup import KeyLookupEnv
from turnrl.harness import HarnessRunner
from turnrl.models import load_tokenizer
from turnrl.rollout.collector import collect
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.imports import add_search_path
from turnrl.types import Limits, SamplingParams, Trajectory

ROOT = Path(__file__).resolve().parents[1]


def tokens(trajs: list[Trajectory]) -> int:
    return sum(sum(t.loss_mask) for t in trajs)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--sides", default="env,harness,bare,forked", help="sides to run, comma-separated")
    args = parser.parse_args()
    add_search_path(ROOT / "examples" / "harness")
    if args.engine == "vllm":
        tokenizer = load_tokenizer(args.model)
        config = VLLMEngineConfig(kind="vllm", max_model_len=4096, kv_cache_gib=2)
        engine: Any = vllm_engine(args.model, config, tokenizer, say=None)
    else:
        engine = hf_engine(args.model)
        tokenizer = engine.tokenizer
    encoder = ChatEncoder(tokenizer)
    samples = to_samples(KeyLookupEnv.dataset(size=args.prompts, seed=5), "bench", None, True)
    spec = RolloutSpec(
        env_factory=KeyLookupEnv,
        engine=engine,
        encoder=encoder,
        sampling=SamplingParams(temperature=1.0, max_tokens=40, seed=0),
        limits=Limits(max_turns=3, max_context_tokens=512),
        check="disable",
    )
    harness = HarnessConfig(
        kind="harness",
        command=["python", str(ROOT / "examples" / "harness" / "lookup_agent.py"), "{prompt}"],
        setup="lookup_task:setup",
        reward="lookup_task:reward",
        tool_parser="hermes",
    )
    out = Path(tempfile.mkdtemp(prefix="turnrl-bench-"))

    def harness_runner(config: HarnessConfig, folder: Path) -> HarnessRunner:
        return HarnessRunner(config, harness_gateway(config, engine, encoder, args.model, folder), folder)

    runner = harness_runner(harness, out)
    bare = harness.model_copy(update={"sandbox": "none"})
    unsandboxed = harness_runner(bare, out / "bare")
    preloaded = bare.model_copy(update={"preload": ["openai", "turnrl.harness.warm:openai"]})
    forked = harness_runner(preloaded, out / "forked")
    boxed = harness.model_copy(update={"preload": preloaded.preload})
    boxed_forked = harness_runner(boxed, out / "boxed")
    every = {
        "env": spec,
        "harness": dataclasses.replace(spec, runner=runner),
        "bare": dataclasses.replace(spec, runner=unsandboxed),
        "forked": dataclasses.replace(spec, runner=forked),
        "sandboxed-forked": dataclasses.replace(spec, runner=boxed_forked),
    }
    sides = {name: every[name] for name in args.sides.split(",")}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(args.repeats + 1):  # the first round warms both up and is not counted
        for name, side in sides.items():
            t0 = time.perf_counter()
            trajs = await collect(samples, side, group_size=args.group, concurrency=64)
            wall = time.perf_counter() - t0
            turns = statistics.fmean(t.num_turns for t in trajs)
            reward = statistics.fmean(t.reward for t in trajs)
            print(
                f"  [{repeat}] {name:<16} {len(trajs):3d} trajectories, {tokens(trajs):5d} sampled tokens, "
                f"{wall:6.2f} s, {tokens(trajs) / wall:7.1f} tok/s, {turns:.2f} turns, reward {reward:.2f}",
                flush=True,
            )
            if repeat:
                rates[name].append(tokens(trajs) / wall)
    for each in (runner, unsandboxed, forked, boxed_forked):
        await each.close()
    await engine.close()
    env = statistics.median(rates["env"])
    where = f"{args.model} on {'a vLLM server' if args.engine == 'vllm' else 'the embedded engine'}"
    print(f"{where}, {args.prompts} prompts x {args.group}, median of {args.repeats} (sampled tok/s):")
    print(f"  env       {env:8.1f}")
    for name in [side for side in sides if side != "env"]:
        rate = statistics.median(rates[name])
        print(f"  {name:<16} {rate:8.1f}   {name} / env: {rate / env:.2f}")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
