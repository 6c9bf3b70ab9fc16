"""Training-side processor outputs, buffered per turn and merged once per key at the end."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class MultimodalBuffer:
    """Per-turn processor outputs (``pixel_values``, ``image_grid_thw``, ...).

    Each turn's dict is kept as it is; ``merge`` concatenates every key once, so each key
    costs one allocation and one copy for the whole trajectory, instead of a copy of the
    growing tensor at every turn (quadratic in turns, with old and new alive at the peak).
    """

    def __init__(self) -> None:
        self._turns: list[Mapping[str, Any]] = []

    def __len__(self) -> int:
        return len(self._turns)

    def append(self, inputs: Mapping[str, Any]) -> None:
        """Keep one turn's outputs (not copied)."""
        if inputs:
            self._turns.append(inputs)

    def merge(self) -> dict[str, Any]:
        """Every key's tensors concatenated along dim 0, once per key."""
        return merge_inputs(self._turns)


def merge_inputs(turns: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Concatenate each key's values along dim 0 (tensors) or as lists (anything else)."""
    import torch

    by_key: dict[str, list[Any]] = {}
    for inputs in turns:
        for key, value in inputs.items():
            by_key.setdefault(key, []).append(value)
    merged: dict[str, Any] = {}
    for key, values in by_key.items():
        if all(isinstance(v, torch.Tensor) for v in values):
            merged[key] = values[0] if len(values) == 1 else torch.cat(values, dim=0)
        else:
            merged[key] = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return merged


def first_images(inputs: Mapping[str, Any], count: int) -> dict[str, Any]:
    """The merged processor outputs of a trajectory's first ``count`` images (a context that
    ends before the later ones): ``image_grid_thw`` rows ``[:count]`` and the ``pixel_values``
    rows of their patches. Empty for no images."""
    if count <= 0 or "image_grid_thw" not in inputs:
        return {}
    grid = inputs["image_grid_thw"]
    if count >= len(grid):
        return dict(inputs)
    rows = int(grid[:count].prod(dim=-1).sum())
    return {"pixel_values": inputs["pixel_values"][:rows], "image_grid_thw": grid[:count]}
