"""Weights into a vLLM server's workers over a process group, not through a file.

The trainer's process is rank 0 of a group of its own with each server's workers (ranks 1..n):
gloo where the weights are on the CPU, NCCL where they are on a GPU. It holds the group's store
(a ``TCPStore`` on a free port), and each worker joins it through turnrl's worker extension
(``init_weight_group``). A push sends the tensors in buckets, one broadcast per bucket of one
dtype, while each worker (``receive_weights``) takes them bucket by bucket into its model's
``load_weights``: nothing is written to or read from a disk, and no worker holds more than one
bucket besides its model.

The group is made with torch's process-group classes directly, not ``init_process_group``: the
worker's own default group (vLLM's) stays as it is, and neither side needs the other's libraries
(vLLM is not importable in the trainer's environment). Both sides must run the same torch release
(vLLM's CPU build and turnrl's test pins both use torch 2.13.0).
"""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20  # a bucket's size: large enough that a broadcast's fixed cost is small


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (what a JSON request carries)."""
    return str(dtype).removeprefix("torch.")


def buckets_of(
    weights: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES
) -> list[list[tuple[str, torch.Tensor]]]:
    """``weights`` in buckets: each of one dtype, in the state dict's order, at most ``bucket_bytes``
    (a tensor larger than that is a bucket alone)."""
    open_: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}
    done: list[list[tuple[str, torch.Tensor]]] = []
    for name, tensor in weights.items():
        size = tensor.numel() * tensor.element_size()
        if open_.get(tensor.dtype) and sizes[tensor.dtype] + size > bucket_bytes:
            done.append(open_.pop(tensor.dtype))
        if tensor.dtype not in open_:
            open_[tensor.dtype], sizes[tensor.dtype] = [], 0
        open_[tensor.dtype].append((name, tensor))
        sizes[tensor.dtype] += size
    return done + list(open_.values())


def layout(buckets: list[list[tuple[str, torch.Tensor]]]) -> list[dict[str, Any]]:
    """What a worker needs to receive ``buckets``: each one's dtype and its tensors' names and shapes."""
    return [
        {"dtype": dtype_name(bucket[0][1].dtype), "tensors": [[name, list(t.shape)] for name, t in bucket]}
        for bucket in buckets
    ]


class WeightGroup:
    """Rank 0 of a process group with one server's ``workers``: it holds the store they join at
    ``host:port`` and broadcasts weights to them."""

    def __init__(
        self, workers: int, *, host: str = "127.0.0.1", backend: str = "gloo", timeout_s: float = 300.0
    ) -> None:
        self.workers = workers
        self.host = host
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            host, 0, workers + 1, is_master=True, timeout=self.timeout, wait_for_workers=False
        )
        self.port = self.store.port
        self.id = uuid.uuid4().hex  # the workers report the id of the group they are in
        self._group: Any = None

    def spec(self) -> dict[str, Any]:
        """What a worker needs to join (``init_weight_group``)."""
        where = {"id": self.id, "host": self.host, "port": self.port, "world_size": self.workers + 1}
        return where | {"backend": self.backend, "timeout_s": self.timeout.total_seconds()}

    def connect(self) -> None:
        """Join the group (blocks until every worker has joined it too, or the timeout)."""
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._group = dist.ProcessGroupNCCL(self.store, 0, self.workers + 1, options)
        else:
            self._group = dist.ProcessGroupGloo(self.store, 0, self.workers + 1, self.timeout)

    def send(self, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Broadcast each bucket as one flat tensor (the workers receive them in the same order)."""
        if self._group is None:
            raise RuntimeError("the weight group is not connected")
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        for bucket in buckets:
            flat = torch.cat([t.detach().reshape(-1).to(device) for _, t in bucket])
            self._group.broadcast(flat, 0).wait()

    def close(self) -> None:
        """Leave the group (the workers' ends go with their servers or their next ``init_weight_group``)."""
        if self._group is not None:
            with contextlib.suppress(Exception):  # a worker already gone
                self._group.shutdown()
            self._group = None
