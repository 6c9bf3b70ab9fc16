"""Vision-language models: images in prompts, tool results and observations, with exact tokens."""

from turnrl.vision.buffer import MultimodalBuffer, merge_inputs
from turnrl.vision.content import ImageError, data_url, load_image
from turnrl.vision.processor import ImageFeatures, ImageInput, ImageTokenError, VisionProcessor

__all__ = [
    "ImageError",
    "ImageFeatures",
    "ImageInput",
    "ImageTokenError",
    "MultimodalBuffer",
    "VisionProcessor",
    "data_url",
    "load_image",
    "merge_inputs",
]
