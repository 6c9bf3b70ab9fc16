"""Engines: the async protocol, the embedded transformers engine and a scripted test double."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from turnrl.engines.scripted import ScriptedEngine, ScriptedReply
from turnrl.types import Engine, EngineError, FinishReason, Generation, SamplingParams

if TYPE_CHECKING:
    from turnrl.engines.balancer import BalancedEngine
    from turnrl.engines.hf import HFEngine
    from turnrl.engines.openai import OpenAIEngine
    from turnrl.engines.sglang import SGLangEngine
    from turnrl.engines.vllm_inproc import VLLMEngine

_LAZY = {
    "BalancedEngine": "turnrl.engines.balancer",
    "HFEngine": "turnrl.engines.hf",
    "OpenAIEngine": "turnrl.engines.openai",
    "SGLangEngine": "turnrl.engines.sglang",
    "VLLMEngine": "turnrl.engines.vllm_inproc",
}

__all__ = [
    "BalancedEngine",
    "Engine",
    "EngineError",
    "FinishReason",
    "Generation",
    "HFEngine",
    "OpenAIEngine",
    "SGLangEngine",
    "SamplingParams",
    "ScriptedEngine",
    "ScriptedReply",
    "VLLMEngine",
]


def __getattr__(name: str) -> Any:
    """Import engines (and so torch, httpx, vllm) only when asked for."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
