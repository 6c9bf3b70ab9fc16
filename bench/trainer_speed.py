"""A GRPO optimizer step, turnrl's against TRL's ``GRPOTrainer``, on the same model and batch.

The batch: ``--rows`` sequences of a ``--prompt``-token prompt and a completion of varied length
(from a quarter of ``--completion`` to all of it), random token ids, one advantage per row
(a group-normalized reward), every completion token trained on. ``--group N``: the rows come in
GRPO groups of N that share their prompt (default 1: every row its own prompt). Each side does
the same work: a forward and backward pass over every row in micro-batches, then one AdamW step.
``--bf16`` runs both under bfloat16 autocast (turnrl: the body; its vocabulary projection stays
float32).

- ``turnrl``: the trainer's path: rows sorted by length into micro-batches of at most
  ``--micro-tokens`` padded tokens (``micro_batches``; ``turnrl-packed``: packed rows of at most
  that many tokens, no padding, as ``train.pack: true`` does), the body's hidden states projected
  through the vocabulary only at trained positions, in chunks (``token_logprobs``), the
  ``ppo`` (clipped) token-mean loss; the first ``--keep-mib`` MiB of each micro-batch's
  probabilities kept for the backward pass (``train.logprob_keep_mib``), the rest recomputed;
  rows that share at least ``--share-min`` prompt tokens go in micro-batches of their own and run
  that prefix once (``train.share_prefix_tokens``; only with ``--group`` above 1).
- ``turnrl-unshared``: ``turnrl`` with every row running its own prompt (``--share-min 0``).
- ``trl``: ``GRPOTrainer.compute_loss`` (TRL's own logprobs, its default loss, entropy as it
  computes it) on micro-batches of ``--trl-rows`` rows in the given order, left-padded prompts
  and right-padded completions as TRL lays them out.

``--head`` times the vocabulary projection alone (one micro-batch's ``--head-positions`` trained
positions, forward and backward), its probabilities kept against recomputed.

``--device cuda`` runs both sides on the GPU (TRL's trainer with ``use_cpu`` off) and reports
each side's peak CUDA memory above the loaded model besides its resident memory.

Each side runs in its own process (so its peak resident memory is its own): one warm-up step,
then ``--steps`` timed steps; trained tokens per second of the median step and the process's peak
RSS above what it held after loading the model. Sides alternate, ``--repeats`` times.

    .venv/bin/python bench/trainer_speed.py [--model smollm2-135m] [--rows 16] [--prompt 128]
        [--completion 384] [--group 1] [--share-min 32] [--steps 3] [--repeats 2] [--bf16]
        [--keep-mib 512] [--sides turnrl,turnrl-packed,turnrl-unshared,trl] [--device cpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
SIDES = ("turnrl", "turnrl-packed", "turnrl-unshared", "trl")
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # bench/vllm.py is not vLLM (TRL looks)


def rss_mib() -> float:
    """Peak resident memory of this process so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    """Resident memory of this process now, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def batch(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """(prompts, completions, advantages), the same for every side (seeded)."""
    g = torch.Generator().manual_seed(0)
    prompts, completions = [], []
    for row in range(args.rows):
        length = int(torch.randint(args.completion // 4, args.completion + 1, (), generator=g))
        fresh = torch.randint(100, vocab, (args.prompt,), generator=g).tolist()
        prompts.append(fresh if row % args.group == 0 else prompts[-1])  # a group shares its first's
        completions.append(torch.randint(100, vocab, (length,), generator=g).tolist())
    rewards = torch.rand(args.rows, generator=g)
    advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
    return prompts, completions, advantages


def turnrl_step(model: Any, optimizer: Any, data: tuple[Any, ...], args: argparse.Namespace) -> int:
    """One optimizer step on turnrl's path; the trained tokens."""
    from turnrl.train.batch import TrainSample, batches_of
    from turnrl.train.logprobs import token_logprobs
    from turnrl.train.loss import LossInputs, LossOptions, policy_loss

    prompts, completions, advantages = data
    samples = [
        TrainSample(
            p + c,
            [0] * len(p) + [1] * len(c),
            [0.0] * len(p) + [-1.0] * len(c),
            [0.0] * len(p) + [a] * len(c),
        )
        for p, c, a in zip(prompts, completions, advantages, strict=True)
    ]
    tokens = sum(len(c) for c in completions)
    optimizer.zero_grad(set_to_none=True)
    share = 0 if args.side == "turnrl-unshared" else args.share_min
    for b in batches_of(samples, args.micro_tokens, 0, args.pack, share):
        b = b.to(model.device)
        logprobs = token_logprobs(
            model,
            b.input_ids_B_T,
            b.attention_mask_B_T,
            b.loss_mask_B_T > 0,
            autocast=args.autocast,
            position_ids_B_T=b.position_ids_B_T,
            keep_mib=args.keep_mib,
            shared_prefix=b.shared_prefix,
            chunk_size=args.chunk,
        )
        old = logprobs.detach()
        inputs = LossInputs(logprobs, old, old, b.advantages_B_T, b.loss_mask_B_T)
        policy_loss("ppo", inputs, LossOptions(), tokens).loss.backward()
    optimizer.step()
    return tokens


def trl_trainer(model: Any, tokenizer: Any, args: argparse.Namespace, out: str) -> Any:
    """TRL's GRPOTrainer around ``model`` (generation never runs here)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=args.trl_rows,
        num_generations=args.trl_rows,
        max_completion_length=args.completion,
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=False,
        logging_steps=1000,
        save_strategy="no",
    )
    data = Dataset.from_list([{"prompt": "x"}] * args.rows)
    return GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
        train_dataset=data, processing_class=tokenizer,
    )  # fmt: skip


def trl_step(trainer: Any, optimizer: Any, data: tuple[Any, ...], args: argparse.Namespace) -> int:
    """One optimizer step through ``GRPOTrainer.compute_loss``; the trained tokens."""
    prompts, completions, advantages = data
    tokens = sum(len(c) for c in completions)
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, len(prompts), args.trl_rows):
        rows = range(start, min(start + args.trl_rows, len(prompts)))
        width = max(len(completions[i]) for i in rows)
        inputs = {
            "prompt_ids": torch.tensor([prompts[i] for i in rows]),
            "prompt_mask": torch.ones(len(rows), args.prompt, dtype=torch.long),
            "completion_ids": torch.tensor(
                [completions[i] + [0] * (width - len(completions[i])) for i in rows]
            ),
            "completion_mask": torch.tensor(
                [[1] * len(completions[i]) + [0] * (width - len(completions[i])) for i in rows]
            ),
            "advantages": torch.tensor([advantages[i] for i in rows]),
            "num_items_in_batch": torch.tensor(float(tokens)),
        }
        inputs = {k: v.to(trainer.model.device) for k, v in inputs.items()}
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.autocast is not None):
            loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()  # TRL's default loss (dapo) is a sum over the step's num_items_in_batch tokens
    optimizer.step()
    return tokens


def run_side(args: argparse.Namespace) -> None:
    """One side in this process; prints a JSON line."""
    from turnrl.models import load_model, load_tokenizer

    torch.manual_seed(0)
    model = load_model(args.model, device=args.device)
    tokenizer = load_tokenizer(args.model)
    model.train()
    data = batch(args, int(model.get_output_embeddings().weight.shape[0]))
    with tempfile.TemporaryDirectory() as out:
        if args.side == "trl":
            trainer = trl_trainer(model, tokenizer, args, out)
            model = trainer.model
            trainer.current_gradient_accumulation_steps = 1  # set by its training loop
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
            step = lambda: trl_step(trainer, optimizer, data, args)  # noqa: E731
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
            step = lambda: turnrl_step(model, optimizer, data, args)  # noqa: E731
        loaded = current_rss_mib()
        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
            cuda_loaded = torch.cuda.memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        step()  # warm-up (AdamW state allocated)
        seconds = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            tokens = step()
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        if args.profile:
            profile(step, cuda)
    result = {"tokens": tokens, "seconds": statistics.median(seconds), "peak": rss_mib(), "loaded": loaded}
    if cuda:
        result["cuda_peak"] = torch.cuda.max_memory_allocated() / 2**20 - cuda_loaded
    print(json.dumps(result))


def profile(step: Any, cuda: bool) -> None:
    """One more step under torch.profiler; its 25 costliest operators (device time on a GPU) to stderr."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profiler(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60), file=sys.stderr)


def head_compare(args: argparse.Namespace) -> None:
    """The vocabulary projection alone (``token_logprobs``' chunks, forward and backward) over one
    micro-batch's trained positions, with the probabilities kept and recomputed, interleaved."""
    from turnrl.models import load_model
    from turnrl.train.logprobs import head_logprobs

    head = load_model(args.model).get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    rows = args.head_positions
    hidden = torch.randn(rows, head.weight.shape[1], generator=g).requires_grad_()
    targets = torch.randint(0, head.weight.shape[0], (rows,), generator=g)

    def run(keep: bool) -> float:
        t0 = time.perf_counter()
        head_logprobs(hidden, head, targets, keep_mib=float("inf") if keep else 0.0).sum().backward()
        return time.perf_counter() - t0

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.steps + 1):
        for keep in (False, True):
            times[keep].append(run(keep))
    recompute, kept = (statistics.median(times[k][1:]) for k in (False, True))
    mib = rows * head.weight.shape[0] * 4 / 2**20
    print(
        f"{args.model}: lm_head {tuple(head.weight.shape)}, {rows} trained positions (kept: {mib:.0f} MiB): "
        f"recomputed {recompute:.3f} s, kept {kept:.3f} s (x{recompute / kept:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--completion", type=int, default=384)
    parser.add_argument("--micro-tokens", type=int, default=4096)
    parser.add_argument("--group", type=int, default=1, help="rows per GRPO group (sharing a prompt)")
    parser.add_argument(
        "--share-min", type=int, default=32, help="turnrl's train.share_prefix_tokens (0: every row its own)"
    )
    parser.add_argument("--trl-rows", type=int, default=4)
    parser.add_argument(
        "--keep-mib", type=float, default=512.0, help="turnrl's train.logprob_keep_mib (0: recompute)"
    )
    parser.add_argument("--chunk", type=int, default=256, help="positions a vocabulary-projection chunk")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="both sides under bfloat16 autocast")
    parser.add_argument(
        "--sides",
        default="turnrl,trl",
        help="of turnrl, turnrl-packed (train.pack: true), turnrl-unshared (--share-min 0), trl",
    )
    parser.add_argument(
        "--head", action="store_true", help="time the vocabulary projection alone, kept against recomputed"
    )
    parser.add_argument("--head-positions", type=int, default=1340, help="trained positions, with --head")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    parser.add_argument(
        "--profile", action="store_true", help="with --side: print torch.profiler's top operators of one step"
    )
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.head:
        head_compare(args)
        return
    args.autocast = torch.bfloat16 if args.bf16 else None
    args.pack = args.side == "turnrl-packed"
    if args.side:
        run_side(args)
        return
    sides = args.sides.split(",")
    if unknown := set(sides) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}; known: {', '.join(SIDES)}")
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for repeat in range(args.repeats):
        for side in results:
            command = [sys.executable, __file__, *sys.argv[1:], "--side", side]
            line = (
                subprocess.run(command, check=True, capture_output=True, text=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            r = json.loads(line)
            results[side].append(r)
            rate = r["tokens"] / r["seconds"]
            gpu = f", CUDA peak {r['cuda_peak']:.0f} MiB above the model" if "cuda_peak" in r else ""
            print(
                f"  [{repeat + 1}] {side:<13} {rate:7.1f} tok/s  step {r['seconds']:.2f}s  "
                f"peak {r['peak']:.0f} MiB ({r['peak'] - r['loaded']:.0f} above the loaded model){gpu}"
            )
    rates = {s: statistics.median(r["tokens"] / r["seconds"] for r in rs) for s, rs in results.items()}
    extra = {s: statistics.median(r["peak"] - r["loaded"] for r in rs) for s, rs in results.items()}
    print(
        f"{args.model}: {args.rows} rows x ({args.prompt} prompt + <= {args.completion} completion) tokens, "
        f"groups of {args.group}"
    )
    for side in results:
        print(f"  {side:<13} {rates[side]:7.1f} tok/s, {extra[side]:.0f} MiB above the loaded model")
    for mine in ("turnrl", "turnrl-packed", "turnrl-unshared"):
        if mine in rates and "trl" in rates:
            print(f"{mine} / TRL tokens/s: {rates[mine] / rates['trl']:.2f}")
    if "turnrl" in rates and "turnrl-packed" in rates:
        print(f"packed / padded tokens/s: {rates['turnrl-packed'] / rates['turnrl']:.2f}")
    if "turnrl" in rates and "turnrl-unshared" in rates:
        print(f"shared / unshared prefixes tokens/s: {rates['turnrl'] / rates['turnrl-unshared']:.2f}")
    if args.json:
        cuda_peak = {
            s: statistics.median(r["cuda_peak"] for r in rs)
            for s, rs in results.items()
            if "cuda_peak" in rs[0]
        }
        print(json.dumps({"rates": rates, "extra_mib": extra, "cuda_peak_mib": cuda_peak}))


if __name__ == "__main__":
    main()
