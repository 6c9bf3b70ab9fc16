"""LoRA adapters (peft) on the policy: only the adapters train; the engine gets merged weights."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from turnrl.train.config import LoraSettings


def wrap_lora(model: Any, settings: LoraSettings, saved: Path | None = None) -> Any:
    """``model`` with fresh LoRA adapters, or with the adapters saved in ``saved`` (a resume)."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError("optim.lora needs peft: pip install 'turnrl[lora]'") from exc
    with warnings.catch_warnings():  # peft asks transformers a question it has renamed
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if saved is not None:
            return peft.PeftModel.from_pretrained(model, str(saved), is_trainable=True)
        config = peft.LoraConfig(
            r=settings.r,
            lora_alpha=settings.alpha,
            lora_dropout=settings.dropout,
            target_modules=list(settings.target_modules),
            bias="none",
        )
        return peft.get_peft_model(model, config)


def is_lora(model: Any) -> bool:
    """Whether ``model`` carries LoRA adapters."""
    return hasattr(model, "peft_config")


def saved_adapter(model_dir: Path) -> bool:
    """Whether a checkpoint's model folder holds adapters rather than a whole model."""
    return (model_dir / "adapter_config.json").is_file()


@torch.no_grad()
def serving_weights(policy: Any) -> dict[str, torch.Tensor]:
    """The weights the engine must serve (a whole state dict unless ``is_lora(policy)``).

    Without LoRA: the policy's state dict. With LoRA: only the adapted layers, each
    ``base weight + scale * B @ A`` under its name in the plain model, which the engine's
    copy of the base model takes with a non-strict update; the policy itself is untouched.
    """
    if not is_lora(policy):
        return dict(policy.state_dict())
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    adapter = policy.active_adapter
    weights: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            layer: Any = module
            weight = layer.get_base_layer().weight
            weights[f"{name}.weight"] = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    return weights


_PEFT_PREFIX = "base_model.model."  # before the plain model's names in a PeftModel's state dict


@torch.no_grad()
def merged_state(state: Mapping[str, torch.Tensor], policy: Any) -> dict[str, torch.Tensor]:
    """The plain model's weights from ``state``, the whole state dict of the LoRA-wrapped ``policy``
    (gathered from FSDP shards): every adapted layer ``base weight + scale * B @ A``."""
    from peft.tuners.lora import LoraLayer

    plain = {
        name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", "."): tensor
        for name, tensor in state.items()
        if ".lora_" not in name
    }
    adapter = policy.active_adapter
    for name, module in policy.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            layer: Any = module
            a, b = (state[f"{_PEFT_PREFIX}{name}.lora_{ab}.{adapter}.weight"] for ab in "AB")
            delta = (b @ a) * layer.scaling[adapter]
            weight = plain[f"{name}.weight"]
            plain[f"{name}.weight"] = weight + (delta.T if layer.fan_in_fan_out else delta).to(weight.dtype)
    return plain


@torch.no_grad()
def full_weights(policy: Any) -> dict[str, torch.Tensor]:
    """Every weight of the plain model an engine serves: the state dict, LoRA layers merged in.

    For engines that reload whole checkpoints (vLLM servers), where a partial update is not possible.
    """
    state = dict(policy.state_dict())
    return merged_state(state, policy) if is_lora(policy) else state
