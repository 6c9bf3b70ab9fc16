"""Models that load offline: a tiny random Qwen3, SmolLM2-135M from a GGUF, local dirs, cached hub ids.

Nothing here touches the network: every load passes ``local_files_only=True``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnrl.models.files import (
    _TINY_FORMAT,
    _TINY_MARKER,
    _TOKENIZER_FILES,
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
from turnrl.support.cache import cache_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from turnrl.vision.processor import VisionProcessor

# SmolLM2-Instruct's ChatML template, used when a GGUF carries none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Where a model lives, resolved from a user string."""

    name: str  # the string the user gave
    path: str  # a local directory or a hub id already in the local cache
    gguf_file: str | None = None  # file name inside ``path`` when the weights are a GGUF
    chat_template: str | None = None  # template to set when the tokenizer has none


def _tiny_qwen3_config(vocab_size: int, num_layers: int, hidden_size: int) -> Any:
    """A Qwen3 config with 32-dim heads, half as many kv heads and a 2x MLP."""
    from transformers import Qwen3Config

    num_heads = max(1, hidden_size // 32)
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=32,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        initializer_range=0.2,  # wide enough for varied greedy outputs (0.02 repeats one token)
        bos_token_id=None,
        eos_token_id=QWEN3_EOS_IDS[0],
        pad_token_id=QWEN3_EOS_IDS[1],
    )


def build_tiny_qwen3(out_dir: str | Path, num_layers: int = 4, hidden_size: int = 128, seed: int = 0) -> Path:
    """Write a tiny random-init Qwen3ForCausalLM with the real Qwen3 tokenizer into ``out_dir``.

    The weights depend only on the arguments; a folder already built with the same ones is kept.
    """
    recipe = {"format": _TINY_FORMAT, "num_layers": num_layers, "hidden_size": hidden_size, "seed": seed}
    return build_once(
        out_dir, recipe, _TINY_MARKER, lambda tmp: _write_tiny_qwen3(tmp, num_layers, hidden_size, seed)
    )


def _write_tiny_qwen3(out: Path, num_layers: int, hidden_size: int, seed: int) -> None:
    """Save the random model, its generation config and the tokenizer files into ``out``."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    tok_dir = qwen3_tokenizer_dir()
    vocab_size = len(AutoTokenizer.from_pretrained(tok_dir, local_files_only=True))
    config = _tiny_qwen3_config(vocab_size, num_layers, hidden_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=list(QWEN3_EOS_IDS), pad_token_id=QWEN3_EOS_IDS[1], do_sample=False
    )
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(tok_dir / name, out / name)


def resolve_model(spec: str) -> ModelSpec:
    """Turn ``tiny-qwen3``, ``smollm2-135m``, a local folder or a cached hub id into a ModelSpec."""
    if spec == TINY_QWEN3:
        return ModelSpec(spec, str(build_tiny_qwen3(cache_dir() / "tiny-qwen3-L4-H128-s0")))
    if spec in TINY_VLMS:
        from turnrl.models.tiny_vlm import build_tiny_vlm

        return ModelSpec(spec, str(build_tiny_vlm(spec, cache_dir() / f"{spec}-s0")))
    if spec == SMOLLM2_135M:
        gguf = smollm2_gguf_path()
        return ModelSpec(spec, str(gguf.parent), gguf.name, SMOLLM2_CHAT_TEMPLATE)
    if spec == SMOLLM2_PLAY:
        folder = cache_dir() / SMOLLM2_PLAY
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(
                f"model {spec!r} is not built yet: `turnrl demo-model` builds it (a few minutes, offline)"
            )
        return ModelSpec(spec, str(folder))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec(spec, str(path.parent), path.name)
    if path.is_dir():
        return ModelSpec(spec, str(path))
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelNotFoundError(f"model {spec!r}: no such folder")
    return ModelSpec(spec, spec)  # a hub id: it must already be in the local cache


def _as_spec(spec: str | ModelSpec) -> ModelSpec:
    """A ModelSpec, resolving strings; loads after this never reach the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return spec if isinstance(spec, ModelSpec) else resolve_model(spec)


def _not_found(ms: ModelSpec, what: str) -> ModelNotFoundError:
    """The one-line error for a model whose files are not on this machine."""
    return ModelNotFoundError(
        f"model {ms.name!r}: no {what} found offline (not a local folder, {TINY_QWEN3!r}, "
        f"{SMOLLM2_135M!r} or a hub id in the local cache)"
    )


_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer_trouble(ms: ModelSpec, err: Exception) -> str:
    """What is wrong with a model folder's tokenizer files, in one line."""
    folder = Path(ms.path)
    if folder.is_dir() and not ms.gguf_file:
        if not any((folder / name).is_file() for name in _TOKENIZER_NAMES):
            return f"{folder} has none of {', '.join(_TOKENIZER_NAMES)}"
        fast = folder / "tokenizer.json"
        if fast.is_file():
            try:
                json.loads(fast.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                return f"{fast} is not valid JSON (cut short?): {exc}"
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"


def load_tokenizer(spec: str | ModelSpec) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a chat template."""
    from transformers import AutoTokenizer

    ms = _as_spec(spec)
    kwargs: dict[str, Any] = {"gguf_file": ms.gguf_file} if ms.gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(ms.path, local_files_only=True, **kwargs)
    except OSError as err:
        raise _not_found(ms, "tokenizer") from err
    except Exception as err:  # files there, but not a tokenizer transformers can read
        raise ModelNotFoundError(
            f"model {ms.name!r}: cannot load its tokenizer: {_tokenizer_trouble(ms, err)}"
        ) from None
    if not tokenizer.chat_template and ms.chat_template:
        tokenizer.chat_template = ms.chat_template
    return tokenizer


def load_model(
    spec: str | ModelSpec, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """The causal LM in eval mode on ``device``, float32 unless ``dtype`` (or its name) says otherwise."""
    import torch

    ms = _as_spec(spec)
    torch_dtype = _torch_dtype(dtype)
    try:
        model = _load_gguf(ms, torch_dtype) if ms.gguf_file else _load_pretrained(ms, torch_dtype)
    except OSError as err:
        raise _not_found(ms, "weights") from err
    except Exception as err:  # a weights file cut short (SafetensorError), a config off
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelNotFoundError(
            f"model {ms.name!r}: cannot load its weights from {ms.path}: {type(err).__name__}: {first}"
        ) from None
    torch.nn.Module.to(model, device)  # in place; PreTrainedModel.to's wrapper confuses type checkers
    return model.eval()


def stop_token_ids(spec: str | ModelSpec, tokenizer: Any) -> list[int]:
    """The ids a server stops on for this model: the tokenizer's eos, plus the ``eos_token_id`` of
    the folder's ``generation_config.json`` (vLLM and SGLang stop on those too; Qwen3 lists both
    ``<|im_end|>`` and ``<|endoftext|>``)."""
    ids = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    path = Path(_as_spec(spec).path) / "generation_config.json"
    if path.is_file():
        import json

        found = json.loads(path.read_text()).get("eos_token_id")
        for i in found if isinstance(found, list) else [found]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def vocab_size(spec: str | ModelSpec) -> int | None:
    """How many token ids the model can sample: its ``config.json``'s ``vocab_size`` (a VLM's
    ``text_config``'s), or None when the folder has no config (a GGUF, a hub id)."""
    ms = _as_spec(spec)
    path = Path(ms.path) / "config.json"
    if ms.gguf_file or not path.is_file():
        return None
    import json

    config = json.loads(path.read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def load_vision_processor(spec: str | ModelSpec, tokenizer: Any) -> VisionProcessor | None:
    """The model's image processor when its folder has one (``preprocessor_config.json``), else None."""
    from turnrl.vision.processor import PREPROCESSOR_CONFIG, VisionProcessor

    ms = _as_spec(spec)
    if ms.gguf_file or not (Path(ms.path) / PREPROCESSOR_CONFIG).is_file():
        return None
    return VisionProcessor.from_pretrained(ms.path, tokenizer)


def _torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """A torch dtype from a dtype, a name such as ``"bfloat16"``, or None (float32)."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"not a floating-point torch dtype: {dtype!r}")
    return value


def _load_pretrained(ms: ModelSpec, dtype: torch.dtype) -> PreTrainedModel:
    """A model folder or cached hub id, through ``from_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(ms.path, local_files_only=True)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model: PreTrainedModel = auto.from_pretrained(ms.path, dtype=dtype, local_files_only=True)
    return model


def _load_gguf(ms: ModelSpec, dtype: torch.dtype) -> PreTrainedModel:
    """A GGUF file, dequantized; this path needs no ``accelerate``, unlike ``from_pretrained(gguf_file=)``."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    assert ms.gguf_file is not None
    config = AutoConfig.from_pretrained(ms.path, gguf_file=ms.gguf_file, local_files_only=True)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parsed = load_gguf_checkpoint(
        str(Path(ms.path) / ms.gguf_file), return_tensors=True, model_to_load=model, torch_dtype=dtype
    )
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelNotFoundError(f"model {ms.name!r}: GGUF weights do not fit ({missing=}, {unexpected=})")
    model.tie_weights()
    model.generation_config = GenerationConfig.from_model_config(config)
    return model


_FOLDER_MARKER = "turnrl_model_folder.json"


def model_folder(spec: str | ModelSpec) -> Path:
    """A Hugging Face folder (safetensors, config, tokenizer with its chat template) for ``spec``,
    as a server process such as vLLM loads it.

    A folder is used as it is; a hub id in the local cache resolves to its snapshot; a GGUF
    (SmolLM2's, or one a user names) is dequantized and saved once as float32 safetensors under
    ``<cache>/folders/``, rebuilt only when the GGUF changes.
    """
    ms = _as_spec(spec)
    if ms.gguf_file is None:
        if Path(ms.path).is_dir():
            return Path(ms.path)
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(ms.path, local_files_only=True))
        except Exception as err:
            raise _not_found(ms, "model folder") from err
    gguf = Path(ms.path) / ms.gguf_file
    stat = gguf.stat()
    recipe = {"gguf": str(gguf), "size": stat.st_size, "mtime": stat.st_mtime, "format": 1}
    out = cache_dir() / "folders" / f"{gguf.stem}-f32"

    def write(tmp: Path) -> None:
        load_model(ms).save_pretrained(tmp)
        load_tokenizer(ms).save_pretrained(tmp)

    return build_once(out, recipe, _FOLDER_MARKER, write)
