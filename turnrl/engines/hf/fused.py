"""The engine's own forward pass for Llama-family models, on fused and packed weights (CPU).

A decode step on CPU streams every weight of the model once (at 32 rows it is bound by memory,
not arithmetic), and the modeling code runs seven matrix products a layer. Here the query, key
and value projections are one product, and the gate and up projections another, each on one
oneDNN-packed weight (``packed``): four products a layer, reading the same bytes in fewer, larger
calls, with no module dispatch between them. SmolLM2-135M at batch 32 on two cores: 48.6 against
53.6 ms a decode step. The arithmetic is the modeling code's (RMSNorm, rotary positions from the
model's own rotary module, grouped-query attention through ``scaled_dot_product_attention``,
SiLU-gated MLP), in another summation order: logits agree to float rounding.

It serves the families whose layers are exactly that (``FAMILIES``: Llama, Mistral, Qwen2,
Qwen3 with its query and key norms; biases where the checkpoint has them), text only; anything
else (vision-language models, other layer shapes) runs the modeling code. The fused weights are
copies made at the first served call and dropped by ``repack`` (after a weight update); the
model's own parameters are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from turnrl.engines.hf.packed import pack as _pack
from turnrl.engines.hf.packed import packed_linear as _linear

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _norm_ok(module: Any) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _layer_ok(layer: Any) -> bool:
    """Whether a decoder layer is pre-norm attention plus a SiLU-gated MLP, nothing more."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    return (
        _norm_ok(getattr(layer, "input_layernorm", None))
        and _norm_ok(getattr(layer, "post_attention_layernorm", None))
        and all(type(getattr(attn, n, None)) is torch.nn.Linear for n in names)
        and all(type(getattr(mlp, n, None)) is torch.nn.Linear for n in ("gate_proj", "up_proj", "down_proj"))
        and type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        and all(_norm_ok(getattr(attn, n)) for n in ("q_norm", "k_norm") if hasattr(attn, n))
        and not any(hasattr(layer, n) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"))
    )


def fusable(model: Any) -> bool:
    """Whether ``model`` is a text model of ``FAMILIES`` whose layers this forward computes exactly
    (the engine also requires ``packing_available``)."""
    inner: Any = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    return (
        getattr(model.config, "model_type", None) in FAMILIES
        and all(hasattr(inner, p) for p in parts)
        and type(getattr(model, "lm_head", None)) is torch.nn.Linear
        and _norm_ok(inner.norm)
        and all(_layer_ok(layer) for layer in inner.layers)
    )


def _bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """The fused product's bias: the layers' biases end to end (zeros for one without), or None."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat(
        [lin.weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias.detach() for lin in linears]
    )


@dataclass
class _Weights:
    """One layer's packed weights (fused where two or three products read the same input)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _weights(layer: Any) -> _Weights:
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    return _Weights(
        _pack(torch.cat([q.weight, k.weight, v.weight])),
        _bias(q, k, v),
        _pack(o.weight),
        _bias(o),
        _pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
        _bias(mlp.gate_proj, mlp.up_proj),
        _pack(mlp.down_proj.weight),
        _bias(mlp.down_proj),
    )


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _mask(mask_B_L: torch.Tensor | None, steps: int, width: int) -> torch.Tensor | None:
    """The boolean ``[B, 1, T, L]`` mask of ``T`` new tokens over ``L`` columns (the last ``T`` new):
    causal, minus the padded columns of ``mask_B_L`` (1 real, 0 pad). A pad before any real token
    sees nothing (torch gives such a query zeros); its output is never used."""
    if steps == 1:
        return None if mask_B_L is None else mask_B_L.bool()[:, None, None, :]
    cols = torch.arange(width, device=mask_B_L.device if mask_B_L is not None else None)
    causal_T_L = cols[None, :] <= (cols[width - steps :])[:, None]
    return causal_T_L[None, None] if mask_B_L is None else causal_T_L & mask_B_L.bool()[:, None, None, :]


class FusedForward:
    """The forward pass above for one model; ``repack`` after its weights change."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._layers: list[_Weights] | None = None
        self._head: torch.Tensor | None = None

    def repack(self) -> None:
        """Drop the fused copies; the next call makes them from the current weights."""
        self._layers, self._head = None, None

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache,
    ) -> torch.Tensor:
        """Logits ``[B, V]`` of each row's last token: ``input_ids`` ``[B, T]`` at ``position_ids``
        after the ``cache``'s columns (appended to it), ``attention_mask`` ``[B, L]`` over every
        column (None: no padding)."""
        inner, cfg = self._model.model, self._model.config
        layers, head = self._layers, self._head
        if layers is None or head is None:
            layers = self._layers = [_weights(layer) for layer in inner.layers]
            head = self._head = _pack(self._model.lm_head.weight)
        rows, steps = input_ids.shape
        hidden = inner.embed_tokens(input_ids)
        cos, sin = (t[:, None] for t in inner.rotary_emb(hidden, position_ids))
        width = cache.get_seq_length() + steps
        mask = _mask(attention_mask, steps, width)
        heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
        for i, (layer, w) in enumerate(zip(inner.layers, layers, strict=True)):
            attn = layer.self_attn
            dim = attn.head_dim
            qkv = _linear(_rms(hidden, layer.input_layernorm), w.qkv, w.qkv_bias)
            q, k, v = qkv.split([heads * dim, groups * dim, groups * dim], -1)
            q, k = q.view(rows, steps, heads, dim), k.view(rows, steps, groups, dim)
            if hasattr(attn, "q_norm"):
                q, k = _rms(q, attn.q_norm), _rms(k, attn.k_norm)
            q = _rotate(q.transpose(1, 2), cos, sin)
            k = _rotate(k.transpose(1, 2), cos, sin)
            keys, values = cache.update(k, v.view(rows, steps, groups, dim).transpose(1, 2), i)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=groups != heads
            )
            hidden = hidden + _linear(out.transpose(1, 2).reshape(rows, steps, heads * dim), w.o, w.o_bias)
            gate, up = _linear(_rms(hidden, layer.post_attention_layernorm), w.gate_up, w.gate_up_bias).chunk(
                2, -1
            )
            hidden = hidden + _linear(F.silu(gate) * up, w.down, w.down_bias)
        return _linear(_rms(hidden[:, -1], inner.norm), head, self._model.lm_head.bias)
