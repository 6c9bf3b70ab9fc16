"""Log-probabilities of given tokens, without materializing ``[B, T, V]`` logits.

The model body runs once and gives hidden states ``[B, T, H]``. Only the positions asked for
are kept (``[N, H]``), then projected through ``lm_head`` chunk by chunk, each chunk
checkpointed by hand: the forward pass keeps only the chunk's hidden states and log-sum-exp,
and the backward pass recomputes the chunk's logits and turns them into their own gradient in
place. So one ``[chunk, V]`` float buffer is alive at a time, in either pass; with a 152k
vocabulary that is the difference between gigabytes and megabytes.

Memory left over buys speed: with ``keep_mib``, the first chunks' probabilities, up to that many
MiB, are kept from the forward pass, and their backward skips the recomputation (one product of
the vocabulary projection's three, and an exponential, per kept chunk). The bound is then
``keep_mib`` plus one chunk.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _logits(
    hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor, bias_V: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """``hidden @ W.T / T`` in float32 (float64 for a float64 model), a fresh tensor; the product
    in ``W``'s dtype (a bfloat16 copy under mixed precision)."""
    bias = bias_V.to(weight_V_H.dtype) if bias_V is not None else None
    logits_N_V = _at_least_float32(F.linear(hidden_N_H.to(weight_V_H.dtype), weight_V_H, bias))
    return logits_N_V.div_(temperature) if temperature != 1.0 else logits_N_V


class _ChunkLogprobs(torch.autograd.Function):
    """``log_softmax(hidden @ W.T / T)[target]`` of one chunk; the backward recomputes the logits,
    unless ``keep`` kept the chunk's probabilities from the forward pass. With ``product_V_H`` (a
    detached low-precision copy of ``W``) the products run in its dtype; the log-softmax, and the
    gradients handed back, stay in float32."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_N_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        bias_V: torch.Tensor | None,
        targets_N: torch.Tensor,
        temperature: float,
        product_V_H: torch.Tensor | None = None,
        keep: bool = False,
    ) -> torch.Tensor:
        matrix = product_V_H if product_V_H is not None else weight_V_H
        logits_N_V = _logits(hidden_N_H, matrix, bias_V, temperature)
        lse_N = torch.logsumexp(logits_N_V, -1)
        picked_N = logits_N_V.gather(-1, targets_N[:, None]).squeeze(-1)
        kept_N_V = logits_N_V.sub_(lse_N[:, None]).exp_() if keep else None  # the softmax, in place
        ctx.save_for_backward(hidden_N_H, weight_V_H, bias_V, targets_N, lse_N, product_V_H, kept_N_V)
        ctx.temperature = temperature
        return picked_N - lse_N

    @staticmethod
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``d logp_n / d logit_nv = (onehot(target_n) - softmax_nv) / T``, built in one buffer."""
        hidden_N_H, weight_V_H, bias_V, targets_N, lse_N, product_V_H, kept_N_V = ctx.saved_tensors
        matrix = product_V_H if product_V_H is not None else weight_V_H
        grad_N = grad_N.to(lse_N.dtype)
        if kept_N_V is not None:  # a new buffer: the kept one stays intact for another backward
            grad_N_V = kept_N_V * -grad_N[:, None]
        else:
            grad_N_V = _logits(hidden_N_H, matrix, bias_V, ctx.temperature).sub_(lse_N[:, None]).exp_()
            grad_N_V.mul_(-grad_N[:, None])
        grad_N_V.scatter_add_(1, targets_N[:, None], grad_N[:, None])
        if ctx.temperature != 1.0:
            grad_N_V.div_(ctx.temperature)
        grad_N_V = grad_N_V.to(matrix.dtype)
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (grad_N_V @ matrix).to(hidden_N_H.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_N_V.T @ hidden_N_H.to(matrix.dtype)).to(weight_V_H.dtype)
        if bias_V is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_N_V.sum(0).to(bias_V.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _check_plain_head(model: PreTrainedModel) -> None:
    """Refuse models that transform their logits after ``lm_head`` (the chunks would miss it)."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_scaling", 1.0) != 1.0:
        raise ValueError(f"{type(model).__name__} rescales its logits; chunked logprobs do not support it")


def token_logprobs(
    model: PreTrainedModel,
    input_ids_B_T: torch.Tensor,
    attention_mask_B_T: torch.Tensor | None = None,
    positions_B_T: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    multimodal: Mapping[str, torch.Tensor] | None = None,
    autocast: torch.dtype | None = None,
    position_ids_B_T: torch.Tensor | None = None,
    keep_mib: float = 0.0,
    shared_prefix: int = 0,
) -> torch.Tensor:
    """``logprobs_B_T[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` under ``softmax(logits / T)``.

    Only positions where ``positions_B_T`` is true are computed (default: every position from 1);
    the others, and position 0, are exactly 0 and get no gradient. ``chunk_size`` is the number
    of positions projected through ``lm_head`` at a time. ``multimodal`` holds a vision-language
    model's image inputs for the batch (``pixel_values``, ``image_grid_thw``: every row's images,
    in row order), as ``Trajectory.multimodal_inputs`` has them. ``autocast`` (``torch.bfloat16``)
    runs the model body under autocast (mixed precision: float32 weights, bfloat16 products) and
    the vocabulary projection's products on a bfloat16 copy of ``lm_head``; the log-softmax, the
    returned logprobs and every gradient stay float32.
    ``position_ids_B_T`` marks packed rows (several sequences end to end, each numbered from 0):
    the attention mask is then left out, and the model keeps each sequence to itself.
    ``keep_mib``: MiB of the chunks' probabilities kept for the backward pass instead of recomputed
    (chunks that fit, from the first; 0: every chunk recomputes, one chunk's buffer at a time).
    ``shared_prefix``: every row begins with these same tokens (a GRPO group's prompt); the body
    runs them once, then every row's rest on their keys and values (see ``_shared_hidden_states``).
    """
    _check_plain_head(model)
    device = input_ids_B_T.device.type
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if shared_prefix and not multimodal and position_ids_B_T is None:
            hidden_B_T_H = _shared_hidden_states(model, input_ids_B_T, attention_mask_B_T, shared_prefix)
        else:
            hidden_B_T_H = _hidden_states(
                model, input_ids_B_T, attention_mask_B_T, multimodal, position_ids_B_T
            )
    return hidden_logprobs(
        model, hidden_B_T_H, input_ids_B_T, positions_B_T,
        temperature=temperature, chunk_size=chunk_size, autocast=autocast, keep_mib=keep_mib,
    )  # fmt: skip


def hidden_logprobs(
    model: PreTrainedModel,
    hidden_B_T_H: torch.Tensor,
    input_ids_B_T: torch.Tensor,
    positions_B_T: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    autocast: torch.dtype | None = None,
    keep_mib: float = 0.0,
) -> torch.Tensor:
    """``token_logprobs`` from the body's last hidden states (``hidden_B_T_H``), through the head."""
    batch, length = input_ids_B_T.shape
    want_B_T = (
        positions_B_T.bool()
        if positions_B_T is not None
        else torch.ones_like(input_ids_B_T, dtype=torch.bool)
    )
    want_B_S = want_B_T[:, 1:]  # S = T - 1: the hidden state at s predicts the token at s + 1
    hidden_N_H = hidden_B_T_H[:, :-1][want_B_S]
    targets_N = input_ids_B_T[:, 1:][want_B_S]
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear), "chunked logprobs need a linear lm_head"
    logprobs_N = head_logprobs(
        hidden_N_H, head, targets_N, temperature=temperature, chunk_size=chunk_size, autocast=autocast,
        keep_mib=keep_mib,
    )  # fmt: skip
    logprobs_B_S = torch.zeros(batch, length - 1, dtype=logprobs_N.dtype, device=input_ids_B_T.device)
    logprobs_B_S = logprobs_B_S.masked_scatter(want_B_S, logprobs_N)
    return F.pad(logprobs_B_S, (1, 0))


def head_logprobs(
    hidden_N_H: torch.Tensor,
    head: torch.nn.Linear,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    autocast: torch.dtype | None = None,
    keep_mib: float = 0.0,
) -> torch.Tensor:
    """``log_softmax(head(hidden_N_H) / T)[targets_N]``, through ``head`` a chunk of positions at a
    time (see ``token_logprobs`` for the options)."""
    product = head.weight.detach().to(autocast) if autocast is not None else None  # cast once
    dtype = torch.promote_types(head.weight.dtype, torch.float32)
    backward = torch.is_grad_enabled() and (hidden_N_H.requires_grad or head.weight.requires_grad)
    row_bytes = head.weight.shape[0] * dtype.itemsize
    budget = keep_mib * 2**20 if backward else 0.0
    pieces = []
    for start in range(0, targets_N.numel(), chunk_size):
        chunk = slice(start, start + chunk_size)
        size = row_bytes * min(chunk_size, targets_N.numel() - start)
        keep = size <= budget
        budget -= size if keep else 0
        piece = _ChunkLogprobs.apply(
            hidden_N_H[chunk], head.weight, head.bias, targets_N[chunk], temperature, product, keep
        )
        pieces.append(piece)
    return torch.cat(pieces) if pieces else hidden_N_H.new_zeros(0, dtype=dtype)


def _hidden_states(
    model: Any,
    input_ids_B_T: torch.Tensor,
    attention_mask_B_T: torch.Tensor | None,
    multimodal: Mapping[str, torch.Tensor] | None,
    position_ids_B_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """The last hidden states; with images, through the vision-language body with multimodal RoPE;
    packed rows (``position_ids_B_T``) without an attention mask: the positions' restarts are the
    only separators."""
    if position_ids_B_T is not None:
        packed: Any = model.get_decoder()
        return packed(
            input_ids=input_ids_B_T, position_ids=position_ids_B_T, use_cache=False
        ).last_hidden_state
    if not multimodal:
        body: Any = model.get_decoder()
        return body(input_ids=input_ids_B_T, attention_mask=attention_mask_B_T).last_hidden_state
    vlm: Any = model.get_base_model() if hasattr(model, "get_base_model") else model
    token_types_B_T = (input_ids_B_T == vlm.config.image_token_id).int()
    grid = multimodal["image_grid_thw"]
    positions, _ = vlm.model.get_rope_index(
        input_ids_B_T,
        mm_token_type_ids=token_types_B_T,
        image_grid_thw=grid,
        attention_mask=attention_mask_B_T,
    )
    out = vlm.model(
        input_ids=input_ids_B_T,
        attention_mask=attention_mask_B_T,
        position_ids=positions,
        pixel_values=multimodal["pixel_values"].to(model.dtype),
        image_grid_thw=grid,
        use_cache=False,
    )
    return out.last_hidden_state


def shares_prefixes(model: Any) -> bool:
    """Whether ``model``'s body can run a shared prefix once (``_shared_hidden_states``): its cache
    holds plain keys and values in every layer (full or sliding-window attention). Linear-attention
    and indexer layers keep other state, so their rows each run their own prefix."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.get_decoder().config)
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)


@functools.cache
def _cache_argument(body_type: Any) -> str:
    """The keyword a transformers body's ``forward`` takes its cache by: ``cache`` in newer
    releases, ``past_key_values`` before (read once per model class)."""
    return "cache" if "cache" in inspect.signature(body_type.forward).parameters else "past_key_values"


def _shared_hidden_states(
    model: Any, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor | None, shared: int
) -> torch.Tensor:
    """The last hidden states of rows that all begin with the same ``shared`` tokens: the body runs
    the prefix once (one row), its keys and values are repeated for every row, and the rows' rest
    runs on them, right after it (positions go on from ``shared``). The gradient of every row
    flows back into the one prefix, so values and gradients are those of the whole rows, at the
    cost of the prefix once instead of once per row."""
    from transformers import DynamicCache

    if not 0 < shared < input_ids_B_T.shape[1]:
        raise ValueError(
            f"a shared prefix of {shared} tokens leaves nothing of {input_ids_B_T.shape[1]}-token rows"
        )
    body: Any = model.get_decoder()
    cache = DynamicCache(config=body.config)
    name = _cache_argument(body.__class__)
    prefix = body(input_ids=input_ids_B_T[:1, :shared], use_cache=True, **{name: cache}).last_hidden_state
    rows = input_ids_B_T.shape[0]
    cache.batch_repeat_interleave(rows)
    rest = body(
        input_ids=input_ids_B_T[:, shared:],
        attention_mask=attention_mask_B_T,
        use_cache=True,
        **{name: cache},
    ).last_hidden_state
    return torch.cat([prefix.expand(rows, -1, -1), rest], 1)


def naive_token_logprobs(
    model: PreTrainedModel,
    input_ids_B_T: torch.Tensor,
    attention_mask_B_T: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The same as ``token_logprobs`` at every position, through full ``[B, T, V]`` logits (reference)."""
    logits_B_T_V = model(input_ids=input_ids_B_T, attention_mask=attention_mask_B_T).logits
    logits_B_T_V = _at_least_float32(logits_B_T_V)
    logprobs_B_S_V = torch.log_softmax(logits_B_T_V[:, :-1] / temperature, -1)
    picked_B_S = logprobs_B_S_V.gather(-1, input_ids_B_T[:, 1:, None]).squeeze(-1)
    return F.pad(picked_B_S, (1, 0))
