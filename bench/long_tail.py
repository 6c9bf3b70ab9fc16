"""Heavy-tailed env latency: request-level collection vs turn-lockstep batching, and envs on Ray.

The workload: trajectories of a fixed number of turns; each env step takes a lognormal time
(median ``--median-ms``, shape ``--sigma``) drawn from a seed per (trajectory, turn), so every
side of a comparison sees exactly the same latencies. The engine is a fake of continuous
batching: each decode step costs ``--step-ms`` plus ``--per-seq-ms`` per sequence in flight and
advances every sequence in flight by one token; a reply is ``--tokens`` tokens.

(a) request level: turnrl's collector, each trajectory its own task, ``--concurrency`` at once.
(b) turn lockstep (ms-swift colocate style): batches of ``--concurrency`` trajectories; turn k is
    generated for every active trajectory as one batch, then every env step of that turn is
    awaited, then turn k+1; the next batch starts when this one is done.
(c) a blocking env (``time.sleep``, or as much pure-Python CPU work) run by the collector: in the
    driver's event loop (local, no Ray) vs on Ray env workers (with and without a thread per env).

    .venv/bin/python bench/long_tail.py [--sigmas 0.5 1.0 1.5] [--skip-ray]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from turnrl.chat.encoder import ChatEncoder
from turnrl.env.base import Env, EnvFactory
from turnrl.models import qwen3_tokenizer_dir
from turnrl.rollout.collector import collect
from turnrl.rollout.spec import RolloutSpec
from turnrl.types import Generation, Limits, Sample, SamplingParams, StepResult, StopReason


def step_latency(seed: int, trajectory: str, turn: int, median_s: float, sigma: float) -> float:
    """The env latency of (trajectory, turn): lognormal, the same for every side."""
    rng = random.Random(zlib.crc32(f"{seed}/{trajectory}/{turn}".encode()))
    return median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


def burn(iterations: int) -> None:
    """A fixed amount of pure-Python CPU work (it holds the GIL throughout)."""
    total = 0
    for i in range(iterations):
        total += i


def iterations_per_second() -> float:
    """How many ``burn`` iterations this machine does per second (calibrates the CPU-bound env)."""
    burn(10**5)
    t0 = time.perf_counter()
    burn(2 * 10**6)
    return 2 * 10**6 / (time.perf_counter() - t0)


class LongTailEnv(Env):
    """Answers every turn after a heavy-tailed delay: awaited, a blocking sleep, or CPU work that long."""

    def __init__(
        self,
        sample: Sample,
        turns: int = 4,
        median_s: float = 0.05,
        sigma: float = 1.25,
        seed: int = 0,
        mode: str = "async",
        cpu_rate: float = 0.0,
    ) -> None:
        super().__init__(sample)
        self.turns, self.median_s, self.sigma, self.seed, self.mode = turns, median_s, sigma, seed, mode
        self.cpu_rate = cpu_rate  # burn iterations per second, for mode "cpu"
        self.steps = 0

    async def step(self, action: str) -> StepResult:
        """Wait this turn's latency, then answer; done after ``turns`` steps."""
        delay = step_latency(self.seed, self.sample.id, self.steps, self.median_s, self.sigma)
        if self.mode == "async":
            await asyncio.sleep(delay)
        elif self.mode == "sleep":
            time.sleep(delay)
        else:
            burn(int(delay * self.cpu_rate))
        self.steps += 1
        return StepResult("Tool output: 42.", reward=1.0, done=self.steps >= self.turns)


@dataclass
class _Request:
    left: int  # tokens still to decode
    done: asyncio.Future[None]


class BatchedEngine:
    """Fake continuous batching: a step costs step_s + per_seq_s * batch and decodes one token for all."""

    def __init__(self, reply_ids: list[int], step_s: float, per_seq_s: float) -> None:
        self.reply_ids = reply_ids
        self.step_s, self.per_seq_s = step_s, per_seq_s
        self.busy_s = 0.0  # time with at least one sequence in flight
        self._running: list[_Request] = []
        self._loop_task: asyncio.Task[None] | None = None

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Any = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Join the running batch; return once the reply's tokens are decoded."""
        request = _Request(len(self.reply_ids), asyncio.get_running_loop().create_future())
        self._running.append(request)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._decode())
        await request.done
        return Generation(list(self.reply_ids), [-0.1] * len(self.reply_ids), "stop")

    async def _decode(self) -> None:
        while self._running:
            t0 = time.perf_counter()
            await asyncio.sleep(self.step_s + self.per_seq_s * len(self._running))
            self.busy_s += time.perf_counter() - t0
            for request in self._running:
                request.left -= 1
            for request in [r for r in self._running if r.left <= 0]:
                request.done.set_result(None)
            self._running = [r for r in self._running if r.left > 0]

    async def close(self) -> None:
        """Nothing to release."""


@dataclass
class Result:
    """One measured side."""

    name: str
    trajectories: int
    steps: int
    seconds: float
    busy_s: float

    @property
    def rate(self) -> float:
        """Trajectories per second."""
        return self.trajectories / self.seconds


def make_samples(count: int) -> list[Sample]:
    return [
        Sample(f"t{i}", [{"role": "user", "content": f"Solve task {i} with the tool."}]) for i in range(count)
    ]


@dataclass
class Bench:
    """What every side shares: the tokenizer, an encoder whose template is probed, the options."""

    tokenizer: Any
    encoder: ChatEncoder
    args: argparse.Namespace

    def engine(self) -> BatchedEngine:
        """A fresh fake engine whose replies are ``--tokens`` tokens long."""
        tokens = self.args.tokens
        words = self.tokenizer.encode("Calling the tool now." * tokens, add_special_tokens=False)
        reply = [*words[: tokens - 1], self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return BatchedEngine(reply, self.args.step_ms / 1e3, self.args.per_seq_ms / 1e3)


def rollout_spec(
    env_factory: EnvFactory, engine: BatchedEngine, encoder: ChatEncoder, turns: int
) -> RolloutSpec:
    limits = Limits(max_turns=turns, max_context_tokens=10**6, env_timeout_s=None)
    return RolloutSpec(
        env_factory, engine, encoder, SamplingParams(max_tokens=10**4), limits, check="disable"
    )


async def request_level(
    bench: Bench, name: str, samples: list[Sample], env_factory: EnvFactory, turns: int
) -> Result:
    """(a) turnrl's collector: every trajectory its own task, at most ``concurrency`` at once."""
    engine = bench.engine()
    spec = rollout_spec(env_factory, engine, bench.encoder, turns)
    t0 = time.perf_counter()
    trajs = await collect(samples, spec, group_size=1, concurrency=bench.args.concurrency)
    seconds = time.perf_counter() - t0
    assert all(t.stop_reason == StopReason.ENV_DONE for t in trajs), {t.stop_reason for t in trajs}
    return Result(name, len(trajs), sum(t.num_turns for t in trajs), seconds, engine.busy_s)


async def lockstep_batch(
    batch: list[Sample], env_factory: EnvFactory, engine: BatchedEngine, encoder: ChatEncoder
) -> int:
    """One batch, turn by turn: generate for all active, then wait for all their env steps."""
    envs = [env_factory(s) for s in batch]
    conv = encoder.conversation(None)
    seqs = [conv.encode_prompt(p) for p in await asyncio.gather(*(e.reset() for e in envs))]
    sampling, active, steps = SamplingParams(max_tokens=10**4), list(range(len(batch))), 0
    while active:
        gens = await asyncio.gather(*(engine.generate(seqs[i], sampling) for i in active))
        texts = [conv.assistant_text(g.token_ids) for g in gens]
        results = await asyncio.gather(
            *(envs[i].step(text) for i, (text, _) in zip(active, texts, strict=True))
        )
        steps += len(active)
        still = []
        for i, gen, (_, last), result in zip(active, gens, texts, results, strict=True):
            seqs[i] = seqs[i] + gen.token_ids
            if not result.done:
                seqs[i] += conv.encode_observation(envs[i].format_observation(result.observation), last)
                still.append(i)
        active = still
    await asyncio.gather(*(e.close() for e in envs))
    return steps


async def turn_lockstep(bench: Bench, samples: list[Sample], env_factory: EnvFactory) -> Result:
    """(b) batches of ``concurrency``, each run turn by turn with a barrier after every turn."""
    engine, size = bench.engine(), bench.args.concurrency
    t0 = time.perf_counter()
    steps = 0
    for start in range(0, len(samples), size):
        steps += await lockstep_batch(samples[start : start + size], env_factory, engine, bench.encoder)
    return Result("turn lockstep", len(samples), steps, time.perf_counter() - t0, engine.busy_s)


def env_factory_for(kwargs: dict[str, Any]) -> Callable[[Sample], Env]:
    return lambda s: LongTailEnv(s, **kwargs)


async def async_comparison(bench: Bench) -> list[tuple[float, Result, Result]]:
    """(a) vs (b) at each sigma, on the same latencies."""
    args, rows = bench.args, []
    samples = make_samples(args.trajectories)
    for sigma in args.sigmas:
        factory = env_factory_for({"turns": args.turns, "median_s": args.median_ms / 1e3, "sigma": sigma})
        lockstep = await turn_lockstep(bench, samples, factory)
        request = await request_level(bench, "request level", samples, factory, args.turns)
        assert request.steps == lockstep.steps
        rows.append((sigma, request, lockstep))
        print(f"  sigma {sigma}: request level {request.seconds:.2f}s, turn lockstep {lockstep.seconds:.2f}s")
    return rows


def parallel_cpu_capacity(workers: int, cpu_rate: float) -> float:
    """How many CPU-bound processes' worth of work this machine does at once (Ray tasks, ~1 s)."""
    import ray

    task = ray.remote(num_cpus=1)(burn)
    iterations = int(0.25 * cpu_rate)
    ray.get(task.remote(1))
    t0 = time.perf_counter()
    ray.get(task.remote(iterations))
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray.get([task.remote(iterations) for _ in range(workers)])
    return workers * alone / (time.perf_counter() - t0)


async def blocking_sides(bench: Bench, mode: str, median_ms: float, cpu_rate: float) -> list[Result]:
    """One blocking env kind: in the driver's loop, then on Ray workers without and with env threads."""
    from turnrl.distributed import RayEnvConfig, RayEnvPool

    args, turns = bench.args, bench.args.blocking_turns
    samples = make_samples(args.blocking_trajectories)
    kwargs = {"turns": turns, "median_s": median_ms / 1e3, "sigma": args.blocking_sigma}
    kwargs.update(mode=mode, cpu_rate=cpu_rate)
    results = [await request_level(bench, "local (no Ray)", samples, env_factory_for(kwargs), turns)]
    for threads in (False, True):
        pool = RayEnvPool(RayEnvConfig(enabled=True, num_workers=args.workers, env_threads=threads))
        pool.ready()
        name = f"Ray, {args.workers} workers" + (", thread per env" if threads else "")
        results.append(await request_level(bench, name, samples, pool.factory(LongTailEnv, kwargs), turns))
        pool.shutdown()
    print("  " + ", ".join(f"{r.name}: {r.seconds:.2f}s" for r in results))
    return results


async def ray_comparison(bench: Bench) -> list[tuple[str, list[Result]]]:
    """(c) blocking and CPU-bound envs: in the driver's loop vs on Ray env workers."""
    import ray

    args = bench.args
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    cpu_rate = iterations_per_second()
    capacity = parallel_cpu_capacity(args.workers, cpu_rate)
    print(f"  {args.workers} CPU-bound processes at once do {capacity:.2f}x the work of one on this machine")
    table = [
        (
            f"time.sleep (median {args.median_ms:g} ms)",
            await blocking_sides(bench, "sleep", args.median_ms, 0),
        ),
        (
            f"CPU-bound Python (median {args.cpu_median_ms:g} ms)",
            await blocking_sides(bench, "cpu", args.cpu_median_ms, cpu_rate),
        ),
    ]
    ray.shutdown()
    return table


def print_async_table(rows: list[tuple[float, Result, Result]], args: argparse.Namespace) -> None:
    print(
        f"\n(a) vs (b): {args.trajectories} trajectories x {args.turns} turns, {args.concurrency} in flight, "
        f"env step lognormal median {args.median_ms:g} ms, {args.tokens}-token replies"
    )
    print("| sigma | request level | turn lockstep | ratio | engine busy: request / lockstep |")
    print("|---|---|---|---|---|")
    for sigma, request, lockstep in rows:
        ratio = request.rate / lockstep.rate
        busy = f"{request.busy_s / request.seconds:.0%} / {lockstep.busy_s / lockstep.seconds:.0%}"
        rates = f"{request.rate:.1f} traj/s | {lockstep.rate:.1f} traj/s"
        print(f"| {sigma:g} | {rates} | **{ratio:.2f}x** | {busy} |")


def print_ray_table(table: list[tuple[str, list[Result]]], args: argparse.Namespace) -> None:
    print(
        f"\n(c): {args.blocking_trajectories} trajectories x {args.blocking_turns} turns, "
        f"{args.concurrency} in flight, sigma {args.blocking_sigma:g}"
    )
    print("| env step | " + " | ".join(r.name for r in table[0][1]) + " |")
    print("|---" * (len(table[0][1]) + 1) + "|")
    for label, results in table:
        base = results[0].rate
        cells = [
            f"{r.rate:.2f} traj/s" + ("" if r is results[0] else f" (**{r.rate / base:.1f}x**)")
            for r in results
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64, help="in flight (a); batch size (b)")
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    parser.add_argument("--median-ms", type=float, default=50.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--per-seq-ms", type=float, default=0.02)
    parser.add_argument("--blocking-trajectories", type=int, default=32)
    parser.add_argument("--blocking-turns", type=int, default=3)
    parser.add_argument("--blocking-sigma", type=float, default=1.0)
    parser.add_argument("--cpu-median-ms", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-ray", action="store_true")
    return parser.parse_args()


async def main_async(args: argparse.Namespace) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    encoder = ChatEncoder(tokenizer)
    encoder.conversation(None)  # probe the template once, outside every timed run
    bench = Bench(tokenizer, encoder, args)
    rows = await async_comparison(bench)
    table = [] if args.skip_ray else await ray_comparison(bench)
    print_async_table(rows, args)
    if table:
        print_ray_table(table, args)


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
