"""Shared fixtures: offline tiny models, built once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (4 layers x 128, real Qwen3 tokenizer and chat template) on disk."""
    from turnrl.models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_qwen3_dir: Path) -> Any:
    """The real Qwen3 tokenizer, with its chat template."""
    from turnrl.models import load_tokenizer

    return load_tokenizer(str(tiny_qwen3_dir))


@pytest.fixture(scope="session")
def tiny_qwen3_model(tiny_qwen3_dir: Path) -> Any:
    """The tiny Qwen3 in float32, shared: do not change its weights (load your own to do that)."""
    from turnrl.models import load_model

    return load_model(str(tiny_qwen3_dir))
