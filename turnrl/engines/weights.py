"""The weight-update interface every engine shares, and loading a checkpoint folder's weights.

``update_weights`` takes either a state dict (in-process engines apply it directly) or the
path of a saved Hugging Face checkpoint folder (servers load it from their own disk; an
in-process engine reads its safetensors files). It returns the new weight version:
``version`` when given, else the engine's previous version plus one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:
    import torch

Weights: TypeAlias = "Mapping[str, torch.Tensor] | str | os.PathLike[str]"


@runtime_checkable
class WeightUpdatable(Protocol):
    """An engine whose weights can be replaced while it runs."""

    async def update_weights(self, weights: Weights, *, version: int | None = None) -> int:
        """Load new weights (a state dict or a checkpoint folder); return the new weight version."""
        ...


def load_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's ``*.safetensors`` files (or of one such file), on CPU."""
    from safetensors.torch import load_file

    root = Path(path)
    files = [root] if root.is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (save it with save_pretrained)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state
