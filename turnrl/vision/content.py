"""Images inside chat messages: finding them, loading them, and writing them to JSON."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from turnrl.types import Message

IMAGE_TYPES = ("image", "image_url")


class ImageError(ValueError):
    """An image part that cannot be read as an image."""


def is_image_part(part: Any) -> bool:
    """Whether a content part is an image (``{"type": "image"}`` or ``{"type": "image_url"}``)."""
    return isinstance(part, dict) and (
        part.get("type") in IMAGE_TYPES or "image" in part or "image_url" in part
    )


def _part_source(part: dict[str, Any]) -> Any:
    if "image" in part:
        return part["image"]
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def load_image(source: Any) -> Any:
    """A PIL RGB image from a PIL image, an ``HxWx3`` uint8 array, bytes, a data URL or a file path."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source if source.mode == "RGB" else source.convert("RGB")
    if hasattr(source, "__array_interface__"):  # numpy arrays (e.g. gymnasium rgb frames)
        return Image.fromarray(source).convert("RGB")
    if isinstance(source, bytes | bytearray):
        return Image.open(io.BytesIO(source)).convert("RGB")
    if isinstance(source, str):
        if source.startswith("data:"):
            try:
                return Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).convert("RGB")
            except Exception as exc:
                raise ImageError(f"bad image data URL: {exc}") from exc
        if source.startswith(("http://", "https://")):
            raise ImageError(f"image URLs are not fetched (offline): {source[:80]}")
        path = Path(source.removeprefix("file://")).expanduser()
        if not path.is_file():
            raise ImageError(f"no image file at {str(path)!r}")
        return Image.open(path).convert("RGB")
    raise ImageError(f"cannot read an image from {type(source).__name__}")


def _map_parts(messages: Sequence[Message], fn: Callable[[Any], Any]) -> list[Message]:
    """Messages with every content part replaced by ``fn(part)``; string contents pass through."""
    out: list[Message] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or not content:
            out.append(message)
        else:
            out.append({**message, "content": [fn(part) for part in content]})
    return out


def normalize_images(messages: Sequence[Message]) -> tuple[list[Message], list[Any]]:
    """Messages whose image parts hold PIL images (``{"type": "image", "image": pil}``), and those
    images in order. Messages without images are passed through as they are."""
    images: list[Any] = []

    def normalized(part: Any) -> Any:
        if is_image_part(part):
            images.append(load_image(_part_source(part)))
            return {"type": "image", "image": images[-1]}
        if not isinstance(part, dict):
            raise ImageError(f"content part of type {type(part).__name__} is not a dict")
        return part

    return _map_parts(messages, normalized), images


def text_parts(content: Any) -> list[str]:
    """The text parts of a message's content, in order (the content itself when it is a string)."""
    if isinstance(content, str):
        return [content]
    return [str(p["text"]) for p in content or [] if isinstance(p, dict) and "text" in p]


def has_images(messages: Sequence[Message]) -> bool:
    """Whether any message has an image part."""
    return any(
        not isinstance(m.get("content"), str) and any(is_image_part(p) for p in m.get("content") or [])
        for m in messages
    )


def count_images(messages: Sequence[Message]) -> int:
    """How many image parts the messages hold."""
    return sum(
        sum(1 for p in m.get("content") or [] if is_image_part(p))
        for m in messages
        if not isinstance(m.get("content"), str)
    )


def data_url(image: Any, fmt: str = "PNG") -> str:
    """A ``data:image/png;base64,...`` URL of a PIL image (lossless by default)."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def messages_to_json(messages: Sequence[Message], images: Sequence[Any]) -> list[Message]:
    """Messages with each PIL image replaced by ``{"type": "image", "image_index": k}`` into ``images``.

    Image parts appear in the messages in the order of ``images``; the k-th part is image k
    (the same picture may appear twice and still gets two indices)."""
    index: dict[int, int] = {}
    for k, image in enumerate(images):
        index.setdefault(id(image), k)
    seen = 0

    def indexed(part: Any) -> Any:
        nonlocal seen
        image = part.get("image") if isinstance(part, dict) else None
        if image is not None and seen < len(images) and images[seen] is image:
            seen += 1
            return {"type": "image", "image_index": seen - 1}
        if image is not None and id(image) in index:
            return {"type": "image", "image_index": index[id(image)]}
        return part

    return _map_parts(messages, indexed)


def messages_from_json(messages: Sequence[Message], images: Sequence[Any]) -> list[Message]:
    """The inverse of ``messages_to_json``: ``image_index`` parts get their image back."""

    def restored(part: Any) -> Any:
        if isinstance(part, dict) and "image_index" in part:
            return {"type": "image", "image": images[part["image_index"]]}
        return part

    return _map_parts(messages, restored)
