"""Linear layers on oneDNN's prepacked weights, for serving on CPU.

On CPU, ``F.linear`` calls a general matrix multiply that re-reads the weight in its stored
layout at every call; a decode step multiplies a few dozen rows by every weight of the model,
so that layout costs most of the step (and some row counts fall on slow paths: 7 rows through
a 49k-vocabulary head took longer than 32). oneDNN reorders each weight once into the blocked
layout its kernels read best (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's
freezing pass does) and multiplies from there: the same float32 arithmetic, in another order.

``PackedLinears`` swaps the forward of every ``nn.Linear`` of a served model for one that reads
the packed weight in threads that called ``serve_packed`` (the engine's worker) and is the plain
``F.linear`` everywhere else, so the model behaves as before for every other caller. The original
weights stay for ``state_dict`` and ``load_state_dict``; after the weights change, ``repack`` must
run before the next served forward (the engine does it after every update).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

_DTYPES = (torch.float32, torch.bfloat16)
_serving = threading.local()


def serve_packed() -> None:
    """Make this thread's forward passes read the packed weights."""
    _serving.on = True


def packing_available(model: torch.nn.Module) -> bool:
    """Whether ``model`` is on CPU in float32 or bfloat16 and torch has oneDNN's linear kernels (for
    bfloat16: and the processor has oneDNN's bfloat16 instructions, without which packing fails)."""
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or params[0].dtype not in _DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if params[0].dtype == torch.bfloat16 and not ops._is_mkldnn_bf16_supported():
        return False
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight reordered once into oneDNN's blocked layout (for ``packed_linear``)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on a weight from ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _Packed:
    """One linear layer's forward on its packed weight, packed at the first served call after
    construction or ``repack`` (so copies and pickles of the model never hold a packed tensor)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        self.linear = linear
        self.weight: torch.Tensor | None = None

    def repack(self) -> None:
        """Drop the packed weight; the next served call packs the current one."""
        self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.linear.bias
        if not getattr(_serving, "on", False) or x.dtype != self.linear.weight.dtype:
            return torch.nn.functional.linear(x, self.linear.weight, bias)
        weight = self.weight  # read once: a closing engine sharing the model may drop it meanwhile
        if weight is None:
            weight = self.weight = pack(self.linear.weight)
        return packed_linear(x, weight, bias)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Packed:
        return _Packed(copy.deepcopy(self.linear, memo))

    def __getstate__(self) -> dict[str, Any]:
        return {"linear": self.linear, "weight": None}


class PackedLinears:
    """Every ``nn.Linear`` of a model served from oneDNN-packed weights (see the module doc).

    A model that is already packed (a second engine over the same model) shares its packs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._layers: list[_Packed] = []
        for module in model.modules():
            if type(module) is torch.nn.Linear and module.weight.dtype in _DTYPES:
                packed = module.__dict__.get("forward")
                if not isinstance(packed, _Packed):
                    packed = _Packed(module)
                    module.forward = packed  # type: ignore[method-assign,assignment]
                self._layers.append(packed)

    def repack(self) -> None:
        """Pack the current weights again at their next served call (after ``load_state_dict``),
        and free the packed copies meanwhile (the engine also calls it when it closes)."""
        for layer in self._layers:
            layer.repack()
