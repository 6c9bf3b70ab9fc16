"""Vision-language prompts: pixel values, image grids and multimodal RoPE positions."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from turnrl.engines.hf.requests import Request
from turnrl.vision.processor import VisionProcessor

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def image_kwargs(
    model: PreTrainedModel, vision: VisionProcessor, request: Request, ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The prefill's image inputs and 3-D positions (``get_rope_index``). The request keeps the
    position shift its images cause, which every decode step adds to the text position."""
    device = model.device
    pixels = torch.cat([image.pixel_values for image in request.images]).to(device, model.dtype)
    grid = torch.cat([image.grid_thw for image in request.images]).to(device)
    token_types = (ids == vision.image_token_id).int()
    positions, delta = model.model.get_rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=grid)
    request.rope_delta = int(delta.reshape(-1)[0])
    return {"pixel_values": pixels, "image_grid_thw": grid, "position_ids": positions}
