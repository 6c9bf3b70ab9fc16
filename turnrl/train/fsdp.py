"""Sharded data-parallel training (``train.fsdp: true`` under ``torchrun``), with FSDP2's ``fully_shard``.

Every decoder layer, then the rest of the policy (embeddings, final norm, ``lm_head``), is sharded
across the ranks: each rank keeps 1/W of every parameter, of its gradient and of its AdamW
moments, and gathers a layer's weights only while that layer runs. Rollouts, samples and the loss
are those of the replicated path (``data_parallel``): each rank trains on its own share, the loss
normalized by the step's loss tokens over every rank; FSDP reduce-scatters the gradients (summed,
not averaged, so the update equals one process's on the whole batch).

Two things follow from sharding. The logprob computation must be the forward of the sharded root
(``ShardedPolicy``), so the root's weights are gathered for it and its gradients reduced. And
every rank must run the layers' collectives equally often, so a rank with fewer micro-batches
than another runs empty ones (``pad_batches``: a two-token batch whose loss is multiplied by 0),
and a micro-batch runs a shared prefix apart (two body calls) only where every rank's batch at
its place does (``agree_on_sharing``).
After each update every rank gathers the full weights for its own engine (``full_state_dict``);
rank 0 writes checkpoints from them, the AdamW moments gathered the same way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from turnrl.train.batch import Batch, TrainSample, collate
from turnrl.train.data_parallel import Ranks, for_collectives
from turnrl.train.logprobs import token_logprobs


class ShardedPolicy(torch.nn.Module):
    """The sharded policy's root: its forward is ``token_logprobs`` of the wrapped model."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``token_logprobs(model, *args, **kwargs)``."""
        return token_logprobs(self.model, *args, **kwargs)


def shard_policy(model: Any, ranks: Ranks) -> ShardedPolicy:
    """Shard ``model`` in place across the ranks (each decoder layer its own unit); its root."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not ranks.distributed:
        raise ValueError("train.fsdp shards the policy across torchrun ranks: start the run with torchrun")
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"train.fsdp: {type(model).__name__} has no decoder layers to shard")
    for layer in layers:
        fully_shard(layer)
    root = ShardedPolicy(model)
    fully_shard(root)
    for module in root.modules():  # sum, not mean: the loss is already normalized over every rank
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no PREMUL_SUM)
    return root


def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The sharded ``model``'s whole state dict, on every rank (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def full_optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The AdamW state of every parameter, gathered on rank 0 (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Give each rank its shard of a saved whole optimizer state (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)


def most_across(count: int, ranks: Ranks) -> int:
    """The largest ``count`` over the ranks."""
    if not ranks.distributed:
        return count
    import torch.distributed as dist

    tensor = for_collectives(torch.tensor([count], dtype=torch.int64))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def pad_batches(
    batches: list[Batch], ranks: Ranks, pad_id: int, device: torch.device | str
) -> list[tuple[Batch, bool]]:
    """``batches`` (each marked real) and as many empty ones on ``device`` (marked not) as this rank
    lacks of the largest count over the ranks: a sharded forward is a collective every rank joins."""
    marked = [(b, True) for b in batches]
    missing = most_across(len(batches), ranks) - len(batches)
    if not missing:
        return marked
    empty = collate([TrainSample([pad_id, pad_id], [0, 1], [0.0, 0.0], [0.0, 0.0])], pad_id).to(device)
    return marked + [(empty, False)] * missing


def agree_on_sharing(marked: list[tuple[Batch, bool]], ranks: Ranks) -> list[tuple[Batch, bool]]:
    """``marked`` (as ``pad_batches`` gives them, the same count on every rank), each running a
    shared prefix apart only where every rank's batch at its place does: such a micro-batch runs
    the body twice (prefix, then rest), and every rank must run each sharded layer as often as
    the others. A batch outvoted loses its shared prefix for good (so its recomputed and trained
    logprobs come the same way); an empty one follows the vote (one token of prefix, one of rest)."""
    if not ranks.distributed:
        return marked
    import torch.distributed as dist

    votes = torch.tensor([bool(b.shared_prefix) or not real for b, real in marked], dtype=torch.int64)
    votes = for_collectives(votes)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)
    out = []
    for (batch, real), vote in zip(marked, votes.tolist(), strict=True):
        if not real:
            batch = replace(batch, shared_prefix=vote)
        elif not vote:
            batch.shared_prefix = 0
        out.append((batch, real))
    return out
