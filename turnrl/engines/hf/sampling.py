"""Sampling one token from raw logits: temperature, top-k, then top-p over the renormalized top-k
set, with the request's generator; the logprob returned is ``log_softmax(logits / T)`` over the
full vocabulary, before any filtering (temperature 1 for greedy), as ``Generation`` requires."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from turnrl.types import SamplingParams

_TOP_P_SHORTLIST = 1024  # top-p first looks for the nucleus among this many most likely tokens
_BLOCK = 256  # tokens per block of the two-level inverse CDF


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


def _draw_rows(scores_B_V: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """Per row, the index of a sample from ``softmax(scores)`` (``_draw``)."""
    return _draw(scores_B_V, generators)[0].tolist()


def _draw(
    scores_B_V: torch.Tensor, generators: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, a sample from ``softmax(scores)`` by the inverse CDF of one uniform number from the
    row's generator, and the row's log normalizer (``logsumexp``, float64): ``[B]`` ids, ``[B]``.

    The weights are ``exp(scores - max)`` in float32 (relative error ~1e-7 each; the largest is 1, so
    they cannot all underflow). The CDF is two-level, so as not to run float64 math over the whole
    vocabulary (a float64 sum over it took 17-28 of a decode step's ~35 ms of sampling at batch 32
    over Qwen's 152k tokens): float32 sums of blocks of ``_BLOCK`` tokens, accumulated in float64,
    find the block; a float64 cumulative sum inside the block finds the token, at the same fraction
    of the block's mass. A token of zero weight is never drawn."""
    rows, vocab = scores_B_V.shape
    top_B1 = scores_B_V.amax(-1, keepdim=True)
    w_B_V = (scores_B_V - top_B1).exp_()
    full = vocab - vocab % _BLOCK
    sums_B_N = w_B_V[:, :full].reshape(rows, -1, _BLOCK).sum(-1).double()
    if full < vocab:  # the last, partial block
        sums_B_N = torch.cat([sums_B_N, w_B_V[:, full:].sum(-1).double()[:, None]], 1)
    cdf_B_N = torch.cumsum(sums_B_N, -1)
    # the generators are the requests' own, on the CPU (their draws do not depend on the device)
    u_B = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    u_B = u_B.to(w_B_V.device)
    target_B1 = (u_B * cdf_B_N[:, -1])[:, None]
    block_B1 = torch.searchsorted(cdf_B_N, target_B1, right=True).clamp_(max=cdf_B_N.shape[1] - 1)
    before_B1 = torch.where(block_B1 > 0, cdf_B_N.gather(1, (block_B1 - 1).clamp(min=0)), 0.0)
    mass_B1 = cdf_B_N.gather(1, block_B1) - before_B1
    ids_B_K = block_B1 * _BLOCK + torch.arange(_BLOCK, device=w_B_V.device)
    inside_B_K = w_B_V.gather(1, ids_B_K.clamp(max=vocab - 1)).double().masked_fill_(ids_B_K >= vocab, 0.0)
    inside_B_K = torch.cumsum(inside_B_K, -1)
    fraction_B1 = ((target_B1 - before_B1) / mass_B1).clamp_(0.0, 1.0)
    within_B1 = torch.searchsorted(inside_B_K, fraction_B1 * inside_B_K[:, -1:], right=True)
    # rounding may put the target at the block's very end: take its last token of weight instead
    last_B1 = torch.searchsorted(inside_B_K, inside_B_K[:, -1:].contiguous())
    within_B1 = torch.minimum(within_B1, last_B1)
    log_total_B = top_B1[:, 0].double() + torch.log(cdf_B_N[:, -1])
    return (block_B1 * _BLOCK + within_B1)[:, 0], log_total_B


def sample_tokens(
    logits_B_V: torch.Tensor, samplings: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[tuple[int, float]]:
    """Sample one token per row from raw logits, each row with its own parameters and generator;
    each token with its full-vocabulary logprob at the row's temperature (1 for greedy).

    A row's token depends only on its logits and generator, never on the other rows."""
    logits_B_V = logits_B_V.float()
    temps = [s.temperature if s.temperature > 0 else 1.0 for s in samplings]
    if any(t != 1.0 for t in temps):
        temps_B = torch.tensor(temps, dtype=logits_B_V.dtype, device=logits_B_V.device)
        logits_B_V = logits_B_V / temps_B[:, None]
    drawn: list[tuple[int, float]] = [(0, 0.0)] * len(samplings)
    plain = []
    for b, s in enumerate(samplings):
        if s.top_k <= 0 and s.top_p >= 1.0 and s.temperature > 0:
            plain.append(b)
            continue
        logprobs_V = torch.log_softmax(logits_B_V[b], -1)
        if s.temperature <= 0:
            token = int(torch.argmax(logits_B_V[b]))
        else:
            values, ids = _candidates(logprobs_V, s.top_k, s.top_p)
            token = int(ids[_draw_rows(values[None], [generators[b]])[0]])
        drawn[b] = (token, float(logprobs_V[token]))
    if plain:
        rows_B_V = logits_B_V if len(plain) == len(samplings) else logits_B_V[plain]  # no 6 MB copy
        ids_B, log_total_B = _draw(rows_B_V, [generators[b] for b in plain])
        picked_B = rows_B_V.gather(1, ids_B[:, None])[:, 0].double() - log_total_B
        for b, token, logprob in zip(plain, ids_B.tolist(), picked_B.tolist(), strict=True):
            drawn[b] = (token, logprob)
    return drawn


def sample_token(
    logits_V: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Sample one token from raw logits; return it with its full-vocabulary logprob at the temperature."""
    return sample_tokens(logits_V[None], [sampling], [generator])[0]
