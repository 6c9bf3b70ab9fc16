"""Helpers the engine tests share: a chat prompt's ids, and logprobs from a fresh forward pass."""

from __future__ import annotations

from typing import Any

import torch


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a one-message chat, generation prompt included."""
    messages = [{"role": "user", "content": text}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def reference_logprobs(
    model: Any,
    prompt: list[int],
    ids: list[int],
    temperature: float = 1.0,
    logit_bias: dict[int, float] | None = None,
) -> list[float]:
    """Logprobs of ``ids`` after ``prompt`` under softmax((logits + bias) / T), from a fresh forward
    pass (``logit_bias`` as the server applied it: vLLM's processed logprobs include it)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    for token, bias in (logit_bias or {}).items():
        logits[:, token] += bias
    logprobs = torch.log_softmax(logits / temperature, -1)
    return [float(logprobs[i, t]) for i, t in enumerate(ids)]


def max_diff(a: list[float], b: list[float]) -> float:
    """The largest absolute difference between two equally long lists."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def sequence_gap(
    model: Any,
    prompt: list[int],
    response: list[int],
    mask: list[int],
    logprobs: list[float],
    temperature: float = 1.0,
    logit_bias: dict[int, float] | None = None,
) -> float:
    """The largest gap between the logprobs a rollout recorded for its model tokens (mask 1) and a
    forward pass over the whole sequence trained on: small only when every turn was generated from
    exactly that sequence (the env tokens between turns included)."""
    ref = reference_logprobs(model, prompt, response, temperature, logit_bias)
    gaps = [abs(a - b) for a, b, m in zip(logprobs, ref, mask, strict=True) if m]
    assert gaps, "no model tokens"
    return max(gaps)
