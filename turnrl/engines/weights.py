"""Loading a checkpoint folder's weights for ``update_weights`` (see ``turnrl.types.WeightUpdatable``).

``update_weights`` takes either a state dict (in-process engines apply it directly) or the
path of a saved Hugging Face checkpoint folder (servers load it from their own disk; an
in-process engine reads its safetensors files with ``load_state_dict``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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
