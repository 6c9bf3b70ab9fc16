"""A vLLM worker extension (``--worker-extension-cls turnrl_vllm_worker.TurnrlWorker``).

Imported by vLLM's worker processes, in vLLM's environment: it needs nothing but torch, and its
methods are called through ``/collective_rpc``.
"""

from __future__ import annotations

from typing import Any


class TurnrlWorker:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

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
