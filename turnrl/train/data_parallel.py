"""Data-parallel training across processes started by ``torchrun`` (torch.distributed).

Every rank holds the whole policy and its own rollout engine. A step's prompts are split across
the ranks (rank ``r`` takes prompts ``r, r + W, ...``; a GRPO group never straddles two ranks, so
its advantages stay exact); each rank rolls out and builds samples from its share. The loss of
every rank is normalized by the loss tokens of the whole step (summed across ranks), and the
gradients are summed across ranks before each optimizer step: the update is the one a single
process makes on the whole batch, and every rank applies it to identical weights, so the weights
stay identical (``dist/param_spread`` checks it each step: 0 when they are).

Gradients are summed by hand, one flat all-reduce per optimizer step, rather than through
``DistributedDataParallel``: ranks hold different numbers of micro-batches (their trajectories
differ in length), and DDP's per-backward hooks would then wait for a backward that never comes.
Rank 0 evaluates, logs and writes checkpoints; every rank writes its own rollouts. Backend: NCCL
when the engine device is CUDA (one GPU per rank, ``cuda:LOCAL_RANK``), gloo on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: evaluates, logs and writes checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


SINGLE = Ranks()


def launched_ranks() -> int:
    """The number of processes ``torchrun`` started (1 when not started by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank among those ``torchrun`` started (0 when not started by it)."""
    return int(os.environ.get("RANK", "0"))


def init_ranks(device: str) -> tuple[Ranks, str]:
    """Join the process group ``torchrun`` set up (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR``...); this rank's place and its device (``cuda`` becomes ``cuda:LOCAL_RANK``)."""
    if launched_ranks() <= 1:
        return SINGLE, device
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size()), device


def close_ranks(ranks: Ranks) -> None:
    """Leave the process group."""
    if ranks.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def shard(items: Sequence[T], ranks: Ranks) -> list[T]:
    """This rank's share of ``items``: every ``world``-th, from ``rank``."""
    return list(items[ranks.rank :: ranks.world])


def barrier(ranks: Ranks) -> None:
    """Wait for every rank."""
    if ranks.distributed:
        import torch.distributed as dist

        dist.barrier()


def for_collectives(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the device the process group's backend reduces on: NCCL takes CUDA tensors
    only (this rank's GPU), gloo CPU ones."""
    import torch.distributed as dist

    return tensor.cuda() if dist.get_backend() == "nccl" else tensor


def sum_across(values: Sequence[float], ranks: Ranks) -> list[float]:
    """Each value summed over the ranks (float64)."""
    if not ranks.distributed:
        return list(values)
    import torch.distributed as dist

    tensor = for_collectives(torch.tensor(list(values), dtype=torch.float64))
    dist.all_reduce(tensor)
    return [float(v) for v in tensor.tolist()]


def sum_gradients(params: Sequence[torch.nn.Parameter], ranks: Ranks) -> None:
    """Replace every parameter's gradient by its sum over the ranks (a rank that trained on nothing
    adds zeros), in one flat all-reduce."""
    if not ranks.distributed or not params:
        return
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for param in params:
        size = param.numel()
        param.grad = flat[offset : offset + size].view_as(param).clone()
        offset += size


def gather(obj: Any, ranks: Ranks) -> list[Any]:
    """``obj`` of every rank, in rank order (picklable objects)."""
    if not ranks.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ranks.world
    dist.all_gather_object(out, obj)
    return out


def param_spread(model: Any, ranks: Ranks) -> float:
    """The largest difference between the ranks' weight checksums (0.0 when every rank holds the
    same weights; always 0.0 in one process)."""
    if not ranks.distributed:
        return 0.0
    with torch.no_grad():
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    sums = gather(checksum, ranks)
    return max(sums) - min(sums)


def clip_gradients(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """Scale the gradients to a global norm of at most ``max_norm``; the norm before. Sharded
    gradients (FSDP's DTensors) count whole: their norm is reduced over the ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    full = getattr(norm, "full_tensor", None)
    norm = full() if full is not None else norm
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)
