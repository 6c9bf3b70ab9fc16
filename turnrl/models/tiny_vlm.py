"""Tiny random-init Qwen2-VL-family models with the real Qwen3 tokenizer, built offline.

They generate with an image in well under a second on a CPU, which is what tests and
examples need: exact token and logprob bookkeeping does not care whether the weights learned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from turnrl.models.files import QWEN3_EOS_IDS, TINY_VLMS, build_once, qwen3_tokenizer_dir
from turnrl.vision.templates import QWEN2_VL_CHAT_TEMPLATE, QWEN3_VL_CHAT_TEMPLATE

_FORMAT = 1
_MARKER = "turnrl_tiny_vlm.json"
_VISION_IDS: dict[str, Any] = {
    "image_token_id": 151655,  # <|image_pad|>
    "video_token_id": 151656,  # <|video_pad|>
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}


def _configs(kind: str, vocab_size: int) -> tuple[Any, Any, int, str]:
    """(config, model class, patch size, chat template) of one tiny model kind."""
    import transformers as tf

    text: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    }
    eos: dict[str, Any] = {"eos_token_id": 151645, "pad_token_id": 151643, "tie_word_embeddings": True}
    if kind == "tiny-qwen2-vl":
        vision: dict[str, Any] = {
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": 128,
            "num_heads": 2,
            "mlp_ratio": 2,
        }
        config: Any = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **_VISION_IDS, **eos)
        return config, tf.Qwen2VLForConditionalGeneration, 14, QWEN2_VL_CHAT_TEMPLATE
    if kind == "tiny-qwen2.5-vl":
        vision = {"depth": 2, "hidden_size": 64, "out_hidden_size": 128, "intermediate_size": 128,
                  "num_heads": 2, "window_size": 56, "fullatt_block_indexes": [1]}  # fmt: skip
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_VISION_IDS, **eos)
        return config, tf.Qwen2_5_VLForConditionalGeneration, 14, QWEN2_VL_CHAT_TEMPLATE
    if kind == "tiny-qwen3-vl":
        text = {**text, "head_dim": 32}
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        vision = {"depth": 2, "hidden_size": 64, "out_hidden_size": 128, "intermediate_size": 128,
                  "num_heads": 2, "patch_size": 16, "deepstack_visual_indexes": [1],
                  "num_position_embeddings": 64}  # fmt: skip
        config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **_VISION_IDS, **eos)
        return config, tf.Qwen3VLForConditionalGeneration, 16, QWEN3_VL_CHAT_TEMPLATE
    raise ValueError(f"unknown tiny VLM {kind!r}; choose from {', '.join(TINY_VLMS)}")


def build_tiny_vlm(kind: str, out_dir: str | Path, seed: int = 0, max_pixels: int = 128 * 128) -> Path:
    """Write a tiny ``kind`` model (see ``TINY_VLMS``), its tokenizer, chat template and image
    processor config into ``out_dir``; a folder already built with the same recipe is kept."""
    recipe = {"format": _FORMAT, "kind": kind, "seed": seed, "max_pixels": max_pixels}
    return build_once(out_dir, recipe, _MARKER, lambda tmp: _write(kind, tmp, seed, max_pixels))


def _write(kind: str, out: Path, seed: int, max_pixels: int) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(), local_files_only=True)
    config, model_class, patch, template = _configs(kind, len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config = GenerationConfig(
        eos_token_id=list(QWEN3_EOS_IDS), pad_token_id=QWEN3_EOS_IDS[1], do_sample=False
    )
    model.save_pretrained(out)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    factor = patch * 2  # patch size x merge size
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": factor * factor,
        "max_pixels": max_pixels,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
