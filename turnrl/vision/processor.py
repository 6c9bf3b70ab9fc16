"""Image processing for the Qwen2-VL family: features per image and image-token expansion.

The chat template writes one ``<|image_pad|>`` per image; the model needs one per merged
patch. ``VisionProcessor`` runs the image processor on new images only (once per image for
the whole trajectory) and expands the placeholders in already-encoded token ids, so earlier
turns are never re-rendered or re-processed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnrl.vision.content import data_url, load_image

if TYPE_CHECKING:
    import torch

IMAGE_TOKEN = "<|image_pad|>"
PREPROCESSOR_CONFIG = "preprocessor_config.json"


class ImageTokenError(ValueError):
    """The token ids do not hold one image placeholder per image, or the wrong number of image tokens."""


@dataclass(eq=False)
class ImageInput:
    """One image of a trajectory: the picture, its processor outputs and its token count."""

    image: Any  # PIL RGB image
    pixel_values: torch.Tensor  # this image's rows of the processor's pixel_values
    grid_thw: torch.Tensor  # [1, 3]: temporal, height, width patches
    num_tokens: int  # <|image_pad|> tokens it takes in the sequence
    _url: str | None = field(default=None, repr=False)

    @property
    def data_url(self) -> str:
        """The image as a PNG data URL, encoded once (server engines send it every turn)."""
        if self._url is None:
            self._url = data_url(self.image)
        return self._url


def image_url(image: Any) -> str:
    """An image as servers take it: a data URL (PNG, lossless; an ``ImageInput``'s own, encoded
    once), or a string (URL, path, data URL) passed through as given."""
    if isinstance(image, str):
        return image
    if isinstance(image, ImageInput):
        return image.data_url
    return data_url(load_image(image))


@dataclass
class ImageFeatures:
    """Processor outputs for the images of one turn, and each image's own slice."""

    inputs: dict[str, Any]  # pixel_values, image_grid_thw (what training consumes)
    images: list[ImageInput]  # per image, in order


class VisionProcessor:
    """A Qwen2-VL-family image processor plus the tokenizer's image token."""

    def __init__(self, image_processor: Any, image_token_id: int) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size = int(getattr(image_processor, "merge_size", 2))

    @classmethod
    def from_tokenizer(
        cls, image_processor: Any, tokenizer: Any, image_token: str = IMAGE_TOKEN
    ) -> VisionProcessor:
        """Take the image token's id from ``tokenizer``."""
        token_id = tokenizer.convert_tokens_to_ids(image_token)
        if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
            raise ImageTokenError(f"the tokenizer has no {image_token!r} token")
        return cls(image_processor, int(token_id))

    @classmethod
    def from_pretrained(cls, path: str | Path, tokenizer: Any) -> VisionProcessor:
        """Read ``preprocessor_config.json`` of a model folder; the PIL backend needs no torchvision."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        config = json.loads((Path(path) / PREPROCESSOR_CONFIG).read_text())
        keys = (
            "min_pixels",
            "max_pixels",
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "image_mean",
            "image_std",
            "size",
        )
        return cls.from_tokenizer(
            Qwen2VLImageProcessorPil(**{k: config[k] for k in keys if k in config}), tokenizer
        )

    def features(self, images: Sequence[Any]) -> ImageFeatures:
        """Process ``images`` (PIL, RGB) in one call; each image keeps a view of its own rows."""
        if not images:
            return ImageFeatures({}, [])
        out = self.image_processor(images=list(images), return_tensors="pt")
        pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
        per_image: list[ImageInput] = []
        row = 0
        for k, image in enumerate(images):
            patches = int(grid[k].prod())
            per_image.append(
                ImageInput(
                    image, pixel_values[row : row + patches], grid[k : k + 1], patches // self.merge_size**2
                )
            )
            row += patches
        return ImageFeatures({"pixel_values": pixel_values, "image_grid_thw": grid}, per_image)

    def expand(self, ids: list[int], images: Sequence[ImageInput]) -> list[int]:
        """``ids`` with the k-th image placeholder repeated ``images[k].num_tokens`` times."""
        token = self.image_token_id
        found = ids.count(token)
        if found != len(images):
            raise ImageTokenError(
                f"the text has {found} image placeholder(s) for {len(images)} image(s); each image part "
                "of a message must render exactly one placeholder"
            )
        if not images:
            return ids
        out: list[int] = []
        k = 0
        for t in ids:
            if t == token:
                out += [token] * images[k].num_tokens
                k += 1
            else:
                out.append(t)
        return out

    def check(self, ids: Sequence[int], images: Sequence[ImageInput]) -> None:
        """Raise when ``ids`` do not hold exactly the image tokens ``images`` need."""
        found = sum(1 for t in ids if t == self.image_token_id)
        needed = sum(image.num_tokens for image in images)
        if found != needed:
            raise ImageTokenError(
                f"the prompt has {found} image tokens but its {len(images)} image(s) need {needed}"
            )


def image_only_processor(vision: VisionProcessor, tokenizer: Any) -> Any:
    """A ``Qwen2VLProcessor`` without its video processor (which needs torchvision): the one-call
    reference encoding of a whole conversation, ``processor(text=..., images=...)``."""
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, **kwargs: Any) -> None:
            self.image_token, self.video_token = IMAGE_TOKEN, "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, **kwargs)

    return ImageOnlyQwen2VLProcessor(vision.image_processor, tokenizer)


def as_image_inputs(images: Sequence[Any], processor: VisionProcessor) -> list[ImageInput]:
    """``ImageInput``s for a mix of ready inputs and raw images (processed here, in one call)."""
    from turnrl.vision.content import load_image

    raw = [k for k, image in enumerate(images) if not isinstance(image, ImageInput)]
    out = list(images)
    if raw:
        done = processor.features([load_image(images[k]) for k in raw]).images
        for k, ready in zip(raw, done, strict=True):
            out[k] = ready
    return out
