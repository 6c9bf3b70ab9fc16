"""One data-parallel rank of tests/test_train_distributed.py, started by torchrun: a fixed batch of
training samples, this rank's share of it, one optimizer step; writes its loss and weights."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from turnrl.models import load_model
from turnrl.train.batch import TrainSample, batches_of, collate, micro_batches
from turnrl.train.config import LoraSettings, TrainConfig
from turnrl.train.data_parallel import close_ranks, init_ranks, shard
from turnrl.train.fsdp import full_state_dict, shard_policy
from turnrl.train.lora import wrap_lora
from turnrl.train.update import Learner, fill_old_logprobs, update_policy


def fixed_samples(count: int) -> list[TrainSample]:
    """``count`` samples of different lengths: a context, then trained tokens with advantages."""
    rng = random.Random(7)
    out = []
    for _ in range(count):
        context, trained = rng.randint(3, 12), rng.randint(2, 9)
        ids = [rng.randrange(1000, 20000) for _ in range(context + trained)]
        advantage = rng.choice([-1.0, 0.5, 1.5])
        out.append(
            TrainSample(
                input_ids=ids,
                loss_mask=[0] * context + [1] * trained,
                rollout_logprobs=[0.0] * context + [-rng.uniform(5, 12) for _ in range(trained)],
                advantages=[0.0] * context + [advantage] * trained,
            )
        )
    return out


def grouped_samples() -> list[TrainSample]:
    """Twelve samples, in GRPO groups of two that begin with the same 10-token prompt: of two
    ranks (every other sample), rank 0 gets three groups, rank 1 one group and four lone samples."""
    rng = random.Random(11)

    def sample(prompt: list[int]) -> TrainSample:
        context = prompt + [rng.randrange(1000, 20000) for _ in range(rng.randint(0, 3))]
        trained = rng.randint(2, 5)
        return TrainSample(
            input_ids=context + [rng.randrange(1000, 20000) for _ in range(trained)],
            loss_mask=[0] * len(context) + [1] * trained,
            rollout_logprobs=[0.0] * len(context) + [-rng.uniform(5, 12) for _ in range(trained)],
            advantages=[0.0] * len(context) + [rng.choice([-1.0, 0.5, 1.5])] * trained,
        )

    prompts = [[rng.randrange(1000, 20000) for _ in range(10)] for _ in range(8)]
    first = [sample(prompts[i // 2]) for i in range(6)]
    second = [sample(prompts[3]) for _ in range(2)] + [sample(prompt) for prompt in prompts[4:]]
    return [s for pair in zip(first, second, strict=True) for s in pair]


def main(model_dir: str, out: str, mode: str = "replicated") -> None:
    """``mode``: replicated (every rank the whole policy), fsdp (sharded across the ranks), lora
    (LoRA adapters on the whole policy) or fsdp-lora (LoRA adapters, the policy sharded); grouped
    (replicated, on ``grouped_samples``) or fsdp-shared (sharded, on them, prefixes shared)."""
    ranks, _ = init_ranks("cpu")
    torch.manual_seed(0)
    policy = load_model(model_dir)
    if "lora" in mode:
        policy = wrap_lora(policy, LoraSettings(r=4))
        with torch.no_grad():  # B starts at 0 (then A gets no gradient): give both a value
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    sharded = shard_policy(policy, ranks) if mode.startswith("fsdp") else None
    config = TrainConfig.model_validate({"model": model_dir, "env": {"name": "guess_number"}})
    # plain SGD: the weights move by the gradient itself (Adam's first step divides each gradient
    # by its own magnitude, which turns rounding in a near-zero gradient into a full-size step)
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    learner = Learner(
        config, policy, None, SimpleNamespace(pad_token_id=0), optimizer, scheduler, ranks, sharded
    )
    samples = grouped_samples() if mode in ("grouped", "fsdp-shared") else fixed_samples(8)
    tokens = sum(sum(s.loss_mask) for s in samples)  # the whole step's loss tokens
    mine = shard(samples, ranks)
    # several micro-batches per rank; under FSDP rank 1 holds fewer (it runs empty ones)
    budget = 40 if ranks.rank == 0 else 80
    if mode == "fsdp-shared":
        batches = batches_of(mine, budget, 0, packed=False, share_min=4)
    else:
        batches = [collate(group, 0) for group in micro_batches(mine, budget)]
    fill_old_logprobs(learner, batches)
    metrics: dict[str, object] = dict(update_policy(learner, batches, tokens))
    metrics["micro_batches"] = len(batches)
    metrics["shared"] = [b.shared_prefix for b in batches]  # after the ranks' votes
    folder = Path(out)
    name = f"{mode}.{ranks.world}.{ranks.rank}"
    weights = full_state_dict(policy) if sharded else policy.state_dict()
    torch.save(weights, folder / f"weights.{name}.pt")
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    torch.save(grads, folder / f"grads.{name}.pt")
    (folder / f"metrics.{name}.json").write_text(json.dumps(metrics))
    close_ranks(ranks)


if __name__ == "__main__":
    main(*sys.argv[1:])
