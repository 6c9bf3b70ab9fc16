"""Engines: the async protocol, the embedded transformers engine and a scripted test double."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl.engines.base import Engine, EngineError, FinishReason, Generation, SamplingParams
from turnrl.engines.scripted import ScriptedEngine, ScriptedReply

if TYPE_CHECKING:
    from turnrl.engines.hf import HFEngine

__all__ = [
    "Engine",
    "EngineError",
    "FinishReason",
    "Generation",
    "HFEngine",
    "SamplingParams",
    "ScriptedEngine",
    "ScriptedReply",
]


def __getattr__(name: str) -> Any:
    """Import HFEngine (and so torch) only when it is asked for."""
    if name == "HFEngine":
        from turnrl.engines.hf import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
