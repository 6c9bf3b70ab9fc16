"""A vLLM worker extension (``--worker-extension-cls turnrl_vllm_worker.TurnrlWorker``).

Imported by vLLM's worker processes, in vLLM's environment: it needs nothing but torch, and its
methods are called through ``/collective_rpc`` (whose arguments are strings: each method here takes
one JSON string). ``init_weight_group`` and ``receive_weights`` are the workers' end of
``turnrl.engines.weight_group``: weights broadcast from the trainer's process, not read from a file.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class TurnrlWorker:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def weight_group_id(self) -> str | None:
        """The id of the weight group this worker is in (None: none). A client whose group is not
        the one every worker is in (another client joined them since, or the server restarted)
        makes a new one."""
        return getattr(self, "_turnrl_weight_group_id", None)

    def init_weight_group(self, spec: str) -> int:
        """Join the trainer's weight group: ``spec`` is JSON with its ``id``, ``host``, ``port``,
        ``world_size``, ``backend`` (gloo or nccl) and ``timeout_s``. Blocks until every member has
        joined; returns this worker's rank in the group. A group this worker held before is left."""
        s = json.loads(spec)
        timeout = datetime.timedelta(seconds=float(s["timeout_s"]))
        rank, size = 1 + int(self.rank), int(s["world_size"])  # type: ignore[attr-defined]
        store = dist.TCPStore(s["host"], int(s["port"]), size, is_master=False, timeout=timeout)
        old = getattr(self, "_turnrl_weight_group", None)
        if old is not None:
            old.shutdown()
        if s["backend"] == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group: Any = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._turnrl_weight_group = group
        self._turnrl_weight_group_id = str(s["id"])
        self._turnrl_weight_device = self.device if s["backend"] == "nccl" else torch.device("cpu")  # type: ignore[attr-defined]
        return rank

    def receive_weights(self, layout: str) -> int:
        """Receive the weights the trainer broadcasts, bucket by bucket as ``layout`` (JSON: a list of
        ``{"dtype", "tensors": [[name, shape], ...]}``) lists them, into the model in place (vLLM's
        own in-place reload, fed from the group instead of a folder); returns the tensors loaded."""
        group = getattr(self, "_turnrl_weight_group", None)
        if group is None:
            raise RuntimeError("no weight group: init_weight_group first")
        buckets = json.loads(layout)
        device = self._turnrl_weight_device
        count = sum(len(b["tensors"]) for b in buckets)

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in buckets:
                shapes = [torch.Size(shape) for _, shape in bucket["tensors"]]
                dtype = getattr(torch, bucket["dtype"])
                flat = torch.empty(sum(s.numel() for s in shapes), dtype=dtype, device=device)
                group.broadcast(flat, 0).wait()
                start = 0
                for (name, _), shape in zip(bucket["tensors"], shapes, strict=True):
                    yield name, flat[start : start + shape.numel()].view(shape)
                    start += shape.numel()

        self.reload_weights(weights_iterator=received())  # type: ignore[attr-defined]
        return count

    def refresh_tied_weights(self) -> int:
        """Redo the weight processing of every layer whose weight another layer also holds.

        vLLM's in-place reload processes a layer only when the checkpoint gave it a tensor. An
        ``lm_head`` tied to the embedding is given none (the checkpoint holds the embedding once),
        so on the CPU build its prepacked copy of the weight (oneDNN or sgl GEMM) keeps the old
        values while the embedding itself has the new ones. Called after each reload; returns how
        many layers were processed (0 where no layer keeps such a copy, e.g. on GPUs).
        """
        model: Any = self.get_model()  # type: ignore[attr-defined]
        holders: dict[int, list[Any]] = {}
        for module in model.modules():
            weight = module._parameters.get("weight")
            if weight is not None:
                holders.setdefault(id(weight), []).append(module)
        done = 0
        for modules in holders.values():
            if len(modules) < 2:
                continue
            for module in modules:
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(module, "cpu_linear"):
                    method.process_weights_after_loading(module)
                    done += 1
        return done
