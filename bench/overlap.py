"""Overlapped against synchronous training, side by side on one workload and seed.

The README demo (SmolLM2-135M-Instruct, key lookup, its supervised warm start, then 6 prompts x
4 samples a step, the top 6 layers trained; without the warm start every reward is 0, every
advantage 0 and no step trains, so there is nothing to overlap). Each round trains ``--steps``
steps synchronously and then overlapped (``train.overlap: true``, ``algorithm.max_staleness: 1``
or ``--max-staleness K``), from the same base weights, in fresh output folders. Reported
per mode: the mean wall time per step (step 1 excluded: it includes the first rollout, which
the overlapped run cannot hide; the mean, as an overlapped run's steps alternate between one that
waits for groups and one that finds them ready) and its median, and trajectories trained on per
second, with the ratios; plus
the overlapped run's staleness share and idle times, and the share of this process's cores each
mode kept busy (``time/cores_busy``; with the embedded engine, generation is in this process).

    .venv/bin/python bench/overlap.py [--steps 5] [--rounds 2]

``--curve`` runs the README demo whole instead (its 16 steps and held-out evaluations at steps
0, 8 and 16), synchronous and then overlapped, and prints both learning curves with wall times.
``--env-latency S`` makes every env step (the tool call) wait S seconds first, as a sandbox, a
web call or a simulated user does: time in which a synchronous step's cores sit idle.

    .venv/bin/python bench/overlap.py --curve [--env-latency 1.0]

``--engine vllm`` rolls out on a vLLM server turnrl starts for each run (after
``scripts/install_vllm.sh``) instead of the embedded engine: generation then runs in the server's
process (on every core, as turnrl binds it; ``VLLM_CPU_OMP_THREADS_BIND=auto`` gives vLLM's own
binding, one core of two here) while the trainer computes in this one.
``--set KEY=VALUE`` (repeatable) changes the workload for both modes, e.g. ``--set
train.prompts_per_step=12`` doubles the groups of a step; ``--overlap-set KEY=VALUE`` changes the
overlapped mode only, e.g. ``--overlap-set train.max_inflight_groups=12``; ``--variant KEY=VALUE``
adds an overlapped run per round with that override as well, against the same synchronous run
(``--engine vllm --variant engine.keep_in_flight=true``: pushes that abort the turns in flight
against pushes that keep them).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from turnrl.app.training import train
from turnrl.env.builtin.key_lookup import KeyLookupEnv
from turnrl.train.config import load_train_config
from turnrl.train.metrics import read_metrics
from turnrl.types import Sample, StepResult

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_key_lookup.yaml"


class SlowKeyLookupEnv(KeyLookupEnv):
    """The demo's env, each step waiting ``latency_s`` first (a slow tool)."""

    def __init__(self, sample: Sample, latency_s: float = 0.0) -> None:
        super().__init__(sample)
        self.latency_s = latency_s

    async def step(self, action: str) -> StepResult:
        """Wait, then step."""
        await asyncio.sleep(self.latency_s)
        return await super().step(action)


PARTS = ("rollout", "train", "sync")  # a synchronous step's parts (time/* in metrics.jsonl)


def env_sets(latency: float) -> list[str]:
    """The overrides that give the demo's env ``latency`` seconds a step (none for 0)."""
    if not latency:
        return []
    return ["env.name=__main__:SlowKeyLookupEnv", f"env.kwargs={{latency_s: {latency}}}"]


def run(
    steps: int,
    overlap: bool,
    out: Path,
    latency: float = 0.0,
    engine: str = "hf",
    staleness: int = 1,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    sets = [
        f"engine.kind={engine}",
        f"train.steps={steps}",
        "train.save_every=0",
        "train.plot=false",
        "eval.every=0",
        "eval.data.limit=1",
        f"output_dir={out}",
        *env_sets(latency),
        *extra,
    ]
    if overlap:
        sets += ["train.overlap=true", f"algorithm.max_staleness={staleness}"]
    config = load_train_config(EXAMPLE, sets)  # with its warm start: rewards vary, so steps train
    t0 = time.perf_counter()
    train(config, console=Console(file=io.StringIO()))
    wall = time.perf_counter() - t0
    records = read_metrics(out / "metrics.jsonl")[1:]
    per_step = [r["time/step"] for r in records[1:]]
    per_batch = config.train.prompts_per_step * config.rollout.group_size
    trajs = sum(per_batch - r.get("train/refused_versions", 0) for r in records[1:])
    return {
        "wall": wall,
        "step_s": statistics.fmean(per_step),  # a pipeline's steps alternate: the mean is its rate
        "median_step_s": statistics.median(per_step),
        "trajs_per_s": trajs / sum(per_step),
        "refused": sum(r.get("train/refused_versions", 0) for r in records),
        "stale": statistics.fmean(1.0 - r.get("async/staleness/0", 0.0) for r in records),
        "trainer_idle": statistics.fmean(r.get("async/trainer_idle_s", 0.0) for r in records),
        "rollout_idle": statistics.fmean(r.get("async/rollout_idle_s", 0.0) for r in records),
        "reward": statistics.fmean(r["reward/mean"] for r in records),
        **{part: statistics.fmean(r.get(f"time/{part}", 0.0) for r in records[1:]) for part in PARTS},
        # this process's cores kept busy over the steps (the embedded engine computes here too)
        "busy": sum(r["time/cores_busy"] * r["time/step"] for r in records[1:]) / sum(per_step),
    }


def overlap_bound(sync: dict[str, Any]) -> float:
    """The most a synchronous step can gain by hiding training and push behind the rollout."""
    whole = sum(sync[part] for part in PARTS)
    return whole / max(sync["rollout"], sync["train"] + sync["sync"])


def curve(
    overlap: bool, out: Path, latency: float, engine: str, staleness: int = 1, extra: tuple[str, ...] = ()
) -> tuple[float, list[tuple[int, float]]]:
    """The whole README demo; its wall time and held-out reward at each evaluation."""
    sets = [f"output_dir={out}", "train.plot=false", "train.save_every=0", *env_sets(latency)]
    sets += [f"engine.kind={engine}", *extra]
    if overlap:
        sets += ["train.overlap=true", f"algorithm.max_staleness={staleness}"]
    t0 = time.perf_counter()
    train(load_train_config(EXAMPLE, sets), console=Console(file=io.StringIO()))
    wall = time.perf_counter() - t0
    records = read_metrics(out / "metrics.jsonl")
    return wall, [(r["step"], r["eval/reward/mean"]) for r in records if "eval/reward/mean" in r]


def curves(
    latency: float, engine: str, staleness: int, extra: tuple[str, ...], overlap_extra: tuple[str, ...]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, overlap in (("synchronous", False), ("overlapped", True)):
            sets = extra + overlap_extra if overlap else extra
            wall, held_out = curve(overlap, Path(tmp) / name, latency, engine, staleness, sets)
            shown = ", ".join(f"step {s}: {r:.3f}" for s, r in held_out)
            print(f"{name}: {wall / 60:.1f} min; held-out reward {shown}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--curve", action="store_true", help="the whole README demo, both learning curves")
    parser.add_argument("--env-latency", type=float, default=0.0, help="seconds every env step waits")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="the rollout engine")
    parser.add_argument("--max-staleness", type=int, default=1, help="the overlapped run's bound")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for both modes"
    )
    parser.add_argument(
        "--overlap-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the overlapped mode only",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more overlapped run per round with this override too (e.g. engine.keep_in_flight=true)",
    )
    args = parser.parse_args()
    if args.curve:
        curves(args.env_latency, args.engine, args.max_staleness, tuple(args.set), tuple(args.overlap_set))
        return
    rows: list[tuple[dict[str, Any], dict[str, Any]]] = []
    variants: dict[str, list[float]] = {v: [] for v in args.variant}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            extra = tuple(args.set)
            sync = run(args.steps, False, Path(tmp) / f"sync{k}", args.env_latency, args.engine, 1, extra)
            over_extra = extra + tuple(args.overlap_set)
            over = run(
                args.steps,
                True,
                Path(tmp) / f"overlap{k}",
                args.env_latency,
                args.engine,
                args.max_staleness,
                over_extra,
            )
            rows.append((sync, over))
            print(f"round {k + 1}: {describe(sync, over)}", flush=True)
            for j, variant in enumerate(args.variant):
                out = Path(tmp) / f"variant{k}-{j}"
                other = run(
                    args.steps,
                    True,
                    out,
                    args.env_latency,
                    args.engine,
                    args.max_staleness,
                    (*over_extra, variant),
                )
                variants[variant].append(sync["step_s"] / other["step_s"])
                print(f"round {k + 1}, overlapped with {variant}: {describe(sync, other)}", flush=True)
    ratio = statistics.median(s["step_s"] / o["step_s"] for s, o in rows)
    print(f"speed-up of the mean step, overlapped against sync (median of rounds): x{ratio:.2f}")
    for variant, ratios in variants.items():
        print(f"  overlapped with {variant}: x{statistics.median(ratios):.2f}")


def describe(sync: dict[str, Any], over: dict[str, Any]) -> str:
    """One round's line: the two modes' steps, rates and the overlapped run's bookkeeping."""
    return (
        f"mean step {sync['step_s']:.1f} s sync, {over['step_s']:.1f} s overlapped "
        f"(x{sync['step_s'] / over['step_s']:.2f}; median {sync['median_step_s']:.1f} against "
        f"{over['median_step_s']:.1f} s); trajectories/s {sync['trajs_per_s']:.2f} "
        f"against {over['trajs_per_s']:.2f}; overlapped: {over['stale']:.0%} of tokens one or more "
        f"versions old, {over['refused']:.0f} refused, trainer idle {over['trainer_idle']:.1f} s "
        f"a step, rollout idle {over['rollout_idle']:.1f} s; mean reward "
        f"{sync['reward']:.3f} sync, {over['reward']:.3f} overlapped; a sync step is "
        f"{sync['rollout']:.1f} s rollout + {sync['train']:.1f} s train + {sync['sync']:.1f} s push "
        f"(overlap bound x{overlap_bound(sync):.2f}); cores busy {sync['busy']:.0%} sync, "
        f"{over['busy']:.0%} overlapped"
    )


if __name__ == "__main__":
    main()
