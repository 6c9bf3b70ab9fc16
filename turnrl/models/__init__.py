"""Models that load offline: shipped names (tiny random Qwen3 and Qwen2-VL-family models,
SmolLM2-135M from a GGUF), local folders, and hub ids already in the local cache."""

from turnrl.models.files import (
    QWEN3_EOS_IDS,
    SMOLLM2_135M,
    SMOLLM2_PLAY,
    TINY_QWEN3,
    TINY_VLMS,
    ModelNotFoundError,
    build_once,
    qwen3_tokenizer_dir,
    smollm2_gguf_path,
)
from turnrl.models.loading import (
    SMOLLM2_CHAT_TEMPLATE,
    ModelSpec,
    build_tiny_qwen3,
    load_model,
    load_tokenizer,
    load_vision_processor,
    model_folder,
    resolve_model,
    stop_token_ids,
    vocab_size,
)
from turnrl.models.tiny_vlm import build_tiny_vlm
from turnrl.support.cache import cache_dir

__all__ = [
    "QWEN3_EOS_IDS",
    "SMOLLM2_135M",
    "SMOLLM2_CHAT_TEMPLATE",
    "SMOLLM2_PLAY",
    "TINY_QWEN3",
    "TINY_VLMS",
    "ModelNotFoundError",
    "ModelSpec",
    "build_once",
    "build_tiny_qwen3",
    "build_tiny_vlm",
    "cache_dir",
    "load_model",
    "load_tokenizer",
    "load_vision_processor",
    "model_folder",
    "qwen3_tokenizer_dir",
    "resolve_model",
    "smollm2_gguf_path",
    "stop_token_ids",
    "vocab_size",
]
