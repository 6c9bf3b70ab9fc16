"""Tool protocol types and the ``BaseTool`` lifecycle (create, execute, calc_reward, release)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ToolSchema = dict[str, Any]
"""An OpenAI function tool schema: ``{"type": "function", "function": {name, description, parameters}}``."""


@dataclass
class ToolCall:
    """One tool call parsed from a model's text."""

    name: str  # the function the model called
    arguments: dict[str, Any]  # its arguments, decoded
    id: str  # stable id within the turn: call00000, call00001...
    raw: str  # the exact text of the call, tags included


@dataclass
class ParseResult:
    """What a tool-call parser found in one model turn."""

    calls: list[ToolCall] = field(default_factory=list)  # well-formed calls, in text order
    errors: list[str] = field(default_factory=list)  # one human-readable line per malformed call
    content: str = ""  # visible text outside the calls (reasoning removed), stripped
    reasoning: str = ""  # the text of the reasoning blocks (a template's reasoning_content)


@dataclass
class ToolOutput:
    """The result of one tool execution."""

    text: str  # what the model sees in the tool message
    reward: float = 0.0  # step reward for this call
    metrics: dict[str, Any] = field(default_factory=dict)  # free-form numbers for logging
    images: list[Any] = field(default_factory=list)  # images the model sees before the text (VLMs)
    done: bool = False  # the call ends the episode (a solved puzzle): stop reason env_done


ExecuteResult = ToolOutput | str | tuple[Any, ...]
"""What ``execute`` may return; ``as_tool_output`` turns it into a ToolOutput."""


class ToolError(Exception):
    """A tool's own failure, said to the model as ``Error: <message>`` and counted as a tool error."""


class ToolArgumentError(ToolError, ValueError):
    """The model called a tool with missing, unknown or ill-typed arguments."""


def normalize_schema(schema: Mapping[str, Any]) -> ToolSchema:
    """Return ``schema`` in the wrapped OpenAI form; a bare ``{name, ...}`` function dict is wrapped.

    Raises ValueError when the schema has no function name.
    """
    if "function" not in schema and "name" in schema:
        schema = {"type": "function", "function": dict(schema)}
    function = schema.get("function")
    if not isinstance(function, Mapping) or not function.get("name"):
        raise ValueError(f"tool schema has no function name: {_short(schema)}")
    return {"type": schema.get("type", "function"), **schema, "function": dict(function)}


def as_tool_output(value: Any) -> ToolOutput:
    """Normalize what ``execute`` returned: a ToolOutput, a str, verl's ``(text, reward, metrics)``,
    an image, verl's multimodal ``{"text": ..., "image": [...]}``, or any other value (JSON-encoded
    when possible)."""
    if isinstance(value, ToolOutput):
        return value
    if isinstance(value, tuple) and 1 <= len(value) <= 3:
        text, reward, metrics = (*value, 0.0, None)[:3]
        out = as_tool_output(text)
        return ToolOutput(out.text, float(reward or 0.0), dict(metrics or {}), out.images)
    if _is_image(value):
        return ToolOutput("", images=[value])
    if isinstance(value, Mapping) and ("image" in value or "images" in value):
        images = value.get("image", value.get("images"))
        images = list(images) if isinstance(images, list | tuple) else [images]
        return ToolOutput(str(value.get("text") or ""), images=[i for i in images if i is not None])
    return ToolOutput(_as_text(value))


def _is_image(value: Any) -> bool:
    """A PIL image or an ``HxWx3`` array."""
    return type(value).__module__.startswith("PIL.") or (
        hasattr(value, "__array_interface__") and len(getattr(value, "shape", ())) == 3
    )


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, Mapping) and isinstance(value.get("text"), str):
        return str(value["text"])  # verl's multimodal response dict
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class BaseTool(ABC):
    """A tool with verl's per-trajectory lifecycle.

    ``create`` runs once per trajectory with a unique ``instance_id``; ``execute`` runs for each call
    of that trajectory; ``calc_reward`` may score the trajectory from the instance's state;
    ``release`` frees it. State kept per instance id lives for the whole trajectory.
    """

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None):
        self.config: dict[str, Any] = dict(config or {})
        self._schema: ToolSchema | None = normalize_schema(tool_schema) if tool_schema else None

    @property
    def schema(self) -> ToolSchema:
        """The OpenAI function schema shown to the model."""
        if self._schema is None:
            raise ValueError(f"{type(self).__name__} has no tool schema; pass tool_schema=...")
        return self._schema

    @property
    def name(self) -> str:
        """The function name the model calls."""
        return str(self.schema["function"]["name"])

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        """Set up the state of one trajectory (default: nothing)."""
        return None

    @abstractmethod
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ExecuteResult:
        """Run one call; return a ToolOutput, a str, or ``(text, reward, metrics)``."""

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """Reward of the trajectory from this tool's view (default: 0; override to take part in scoring)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free the state of one trajectory (default: nothing)."""
        return None

    def overrides_calc_reward(self) -> bool:
        """True when a subclass implements ``calc_reward``."""
        return type(self).calc_reward is not BaseTool.calc_reward

    def __repr__(self) -> str:
        name = self.name if self._schema is not None else "?"
        return f"{type(self).__name__}(name={name!r})"
