"""Training on an agent harness's forest of branches: shared prefixes computed once, against the
same branches trained separately (goal: ≥1.5× trained tokens/s when prefixes are long); and the
trunk trained once per run (what turnrl trains now) against once per branch (before).

A group holds ``--runs`` runs of one prompt (``--prompt`` tokens, shared by all); each run left
``--branches`` branches (a retry, an edit, a truncation: forks of the run's trunk) that share the
run's first ``--trunk`` tokens after the prompt, and each branch has ``--suffix`` tokens of its
own, trained (mask 1) as the trunk is. One optimizer step (forward and backward of turnrl's loss)
over the group, with ``train.share_prefix_tokens`` at 32 (shared) and 0 (separate), the trunk
trained in every branch or in the run's first only, alternating, median of ``--repeats``; the policy
is SmolLM2-135M on this machine's CPU.

    .venv/bin/python bench/forest_training.py [--runs 4] [--branches 3] [--prompt 256] [--trunk 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from turnrl.models import load_model, resolve_model
from turnrl.train.batch import TrainSample, batches_of
from turnrl.train.logprobs import token_logprobs
from turnrl.train.loss import LossInputs, LossOptions, policy_loss


def forest(args: argparse.Namespace, vocab: int, trunk_once: bool) -> list[TrainSample]:
    """One group's branches as training samples (random token ids, seeded); ``trunk_once``: the
    trunk trained in the run's first branch only, context in the others (``turnrl.gateway.forest``),
    else in every branch (before: a forked branch trained its trunk again)."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    prompt = ids(args.prompt)
    out = []
    for _ in range(args.runs):
        trunk = ids(args.trunk)
        for k in range(args.branches):
            tail = ids(args.suffix)
            trained_trunk = 0 if trunk_once and k else 1
            mask = [0] * len(prompt) + [trained_trunk] * len(trunk) + [1] * len(tail)
            out.append(
                TrainSample(
                    prompt + trunk + tail,
                    mask,
                    [-1.0 * m for m in mask],
                    [rng.choice([-1.0, 1.0]) * m for m in mask],
                )
            )
    return out


def step(model: Any, optimizer: Any, samples: list[TrainSample], share: int, micro: int) -> tuple[int, int]:
    """One optimizer step; (trained tokens, tokens the model ran)."""
    tokens = sum(sum(s.loss_mask) for s in samples)
    optimizer.zero_grad(set_to_none=True)
    ran = 0
    for b in batches_of(samples, micro, 0, False, share):
        rows, width = b.input_ids_B_T.shape
        ran += b.shared_prefix + rows * (width - b.shared_prefix)
        logprobs = token_logprobs(
            model, b.input_ids_B_T, b.attention_mask_B_T, b.loss_mask_B_T > 0, shared_prefix=b.shared_prefix
        )
        old = logprobs.detach()
        inputs = LossInputs(logprobs, old, old, b.advantages_B_T, b.loss_mask_B_T)
        policy_loss("ppo", inputs, LossOptions(), tokens).loss.backward()
    optimizer.step()
    return tokens, ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--trunk", type=int, default=512)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--micro-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model(resolve_model(args.model))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    sides = {  # name: (trunk trained once, share_prefix_tokens)
        "separate, trunk per branch": (False, 0),
        "shared, trunk per branch": (False, 32),
        "shared, trunk once": (True, 32),
    }
    samples = {name: forest(args, model.config.vocab_size, once) for name, (once, _) in sides.items()}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    walls: dict[str, list[float]] = {name: [] for name in sides}
    trained: dict[str, int] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, (_, share) in sides.items():
            t0 = time.perf_counter()
            tokens, ran = step(model, optimizer, samples[name], share, args.micro_tokens)
            wall = time.perf_counter() - t0
            print(
                f"  [{repeat}] {name:<27} {tokens} trained tokens, {ran} run, "
                f"{wall:6.2f} s, {tokens / wall:7.1f} tok/s"
            )
            trained[name] = tokens
            if repeat:
                rates[name].append(tokens / wall)
                walls[name].append(wall)
    shape = f"{args.runs} runs x {args.branches} branches, prompt {args.prompt}"
    shape += f" + trunk {args.trunk} + {args.suffix}"
    print(f"{args.model}: {shape}, median of {args.repeats}:")
    base = statistics.median(walls["separate, trunk per branch"])
    for name in sides:
        wall = statistics.median(walls[name])
        print(
            f"  {name:<27} {trained[name]:6d} trained tokens  {wall:6.2f} s/step  "
            f"{statistics.median(rates[name]):7.1f} trained tok/s  step time / separate: {wall / base:.2f}"
        )


if __name__ == "__main__":
    main()
