"""Sampling one token from raw logits: temperature, top-k, then top-p over the renormalized top-k
set, with the request's generator; the logprob returned is ``log_softmax(logits / T)`` over the
full vocabulary, before any filtering (temperature 1 for greedy), as ``Generation`` requires."""

from __future__ import annotations

import torch

from turnrl.types import SamplingParams

_TOP_P_SHORTLIST = 1024  # top-p first looks for the nucleus among this many most likely tokens


def _draw(logprobs_K: torch.Tensor, generator: torch.Generator) -> int:
    """Index of a sample from unnormalized log-probabilities (inverse CDF, float64)."""
    cdf = torch.cumsum(torch.exp(logprobs_K.double() - logprobs_K.max()), 0)
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * cdf[-1:]
    return min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)


def _nucleus(values_K: torch.Tensor, top_p: float) -> int:
    """How many of the sorted (descending) log-probabilities form the top-p nucleus."""
    probs = torch.softmax(values_K.double(), 0)
    before = torch.cumsum(probs, 0) - probs  # mass of the tokens ranked above each token
    return max(1, int((before < top_p).sum()))


def _candidates(logprobs_V: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens top-k then top-p keep, sorted by probability: (log-probabilities, ids)."""
    vocab = logprobs_V.numel()
    k = min(top_k, vocab) if top_k > 0 else min(_TOP_P_SHORTLIST, vocab)
    values, ids = torch.topk(logprobs_V, k)
    if top_k <= 0 and k < vocab and float(values.exp().sum()) < top_p:
        values, ids = torch.sort(logprobs_V, descending=True)  # the nucleus is wider than the shortlist
    n = _nucleus(values, top_p) if top_p < 1.0 else k
    return values[:n], ids[:n]


def sample_token(
    logits_V: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Sample one token from raw logits; return it with its full-vocabulary logprob at the temperature."""
    logits_V = logits_V.float()
    if sampling.temperature <= 0:
        logprobs_V = torch.log_softmax(logits_V, -1)
        token = int(torch.argmax(logits_V))
        return token, float(logprobs_V[token])
    logprobs_V = torch.log_softmax(logits_V / sampling.temperature, -1)
    if sampling.top_k <= 0 and sampling.top_p >= 1.0:
        token = _draw(logprobs_V, generator)
    else:
        values, ids = _candidates(logprobs_V, sampling.top_k, sampling.top_p)
        token = int(ids[_draw(values, generator)])
    return token, float(logprobs_V[token])
