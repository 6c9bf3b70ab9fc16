"""Token-mean policy losses: PPO clipping, rollout importance correction (TIS / MIS), KL to a reference.

Three log-probabilities meet here, per response token:

- ``logprobs``: the policy being trained (with gradient);
- ``old_logprobs``: the behaviour policy of the PPO ratio, computed by the trainer before the
  update (or the rollout's, when it does not recompute them);
- ``rollout_logprobs``: what the engine reported when it sampled the token.

The PPO ratio is ``exp(logprobs - old_logprobs)``. The rollout ratio ``exp(old_logprobs -
rollout_logprobs)`` measures how far the engine's sampling distribution is from the trainer's
(different kernels, precision, or an older policy) and corrects for it:

- ``tis`` (truncated IS): every token's loss is weighted by ``min(ratio, tis_cap)``, detached;
- ``mis`` (masked IS): tokens whose ratio is outside ``[mis_low, mis_high]`` are dropped.

The loss is a token mean: the sum over every kept token divided by ``normalizer``, the number
of loss tokens of the whole optimizer step, so micro-batches add up to the full-batch loss.
Dropped (MIS) tokens leave the normalizer unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Importance = Literal["none", "tis", "mis"]


@dataclass(frozen=True)
class LossOptions:
    """The loss's knobs."""

    clip_low: float = 0.2  # PPO: the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    importance: Importance = "none"  # rollout correction: none, tis or mis
    tis_cap: float = 2.0  # TIS: weights are capped at this
    mis_low: float = 0.5  # MIS: tokens with a ratio outside [mis_low, mis_high] are dropped
    mis_high: float = 2.0
    kl_coef: float = 0.0  # weight of the k3 KL estimate to the reference policy


@dataclass
class LossInputs:
    """Per-token tensors of one (micro-)batch, all ``[B, T]``."""

    logprobs_B_T: torch.Tensor  # the trained policy's, with gradient
    old_logprobs_B_T: torch.Tensor  # behaviour policy of the PPO ratio
    rollout_logprobs_B_T: torch.Tensor  # the engine's, at sampling time
    advantages_B_T: torch.Tensor
    mask_B_T: torch.Tensor  # 1.0 where the token is trained on
    ref_logprobs_B_T: torch.Tensor | None = None  # reference policy, for the KL term


PolicyTerm = Callable[[LossInputs, LossOptions], tuple[torch.Tensor, torch.Tensor]]
"""Per-token policy loss ``[B, T]`` and a 0/1 tensor of where the ratio was clipped."""
POLICY_LOSSES: dict[str, PolicyTerm] = {}


def register_loss(name: str) -> Callable[[PolicyTerm], PolicyTerm]:
    """Decorator: make a per-token policy loss usable as ``algorithm.loss: name``."""

    def add(fn: PolicyTerm) -> PolicyTerm:
        POLICY_LOSSES[name] = fn
        return fn

    return add


def _ratio(inputs: LossInputs) -> torch.Tensor:
    return torch.exp(inputs.logprobs_B_T - inputs.old_logprobs_B_T)


@register_loss("ppo")
def ppo_clip(inputs: LossInputs, options: LossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate: ``-min(r A, clip(r, 1 - lo, 1 + hi) A)``."""
    ratio, adv = _ratio(inputs), inputs.advantages_B_T
    clipped = torch.clamp(ratio, 1 - options.clip_low, 1 + options.clip_high)
    unclipped_loss, clipped_loss = -ratio * adv, -clipped * adv
    return torch.maximum(unclipped_loss, clipped_loss), (clipped_loss > unclipped_loss).float()


@register_loss("pg")
def policy_gradient(inputs: LossInputs, options: LossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Unclipped importance-weighted policy gradient: ``-r A`` (REINFORCE when on-policy)."""
    return -_ratio(inputs) * inputs.advantages_B_T, torch.zeros_like(inputs.logprobs_B_T)


@register_loss("cispo")
def cispo(inputs: LossInputs, options: LossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: the clipped ratio as a detached weight on ``-A log p``, so no token loses its gradient."""
    ratio = _ratio(inputs).detach()
    weight = torch.clamp(ratio, 1 - options.clip_low, 1 + options.clip_high)
    return -weight * inputs.advantages_B_T * inputs.logprobs_B_T, (weight != ratio).float()


def rollout_ratio(inputs: LossInputs) -> torch.Tensor:
    """``exp(old - rollout)``: how much likelier the trainer finds each token than the engine did."""
    return torch.exp(inputs.old_logprobs_B_T - inputs.rollout_logprobs_B_T).detach()


def importance_weights(inputs: LossInputs, options: LossOptions) -> torch.Tensor:
    """Per-token weights of the rollout correction: TIS caps, MIS keeps (1) or drops (0), none is 1."""
    ratio = rollout_ratio(inputs)
    if options.importance == "tis":
        return torch.clamp(ratio, max=options.tis_cap)
    if options.importance == "mis":
        return ((ratio >= options.mis_low) & (ratio <= options.mis_high)).float()
    return torch.ones_like(ratio)


def kl_k3(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(policy || ref) per token: ``exp(d) - d - 1``, ``d = ref - logp``."""
    delta = ref_logprobs_B_T - logprobs_B_T
    return torch.exp(delta) - delta - 1


@dataclass
class LossResult:
    """The loss to backpropagate, and token sums for the step's metrics."""

    loss: torch.Tensor  # scalar, with gradient
    tokens: float  # loss tokens in this micro-batch
    clipped: float  # tokens whose PPO ratio was clipped
    kl_sum: float  # sum of the per-token k3 KL (0 without a reference)


def _finite_where_masked(inputs: LossInputs) -> LossInputs:
    """Zero every logprob where the mask is 0, so padding garbage cannot turn into inf * 0 = NaN
    (those tokens then get exactly zero gradient)."""
    keep = inputs.mask_B_T > 0

    def clean(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t, torch.zeros_like(t))

    ref = inputs.ref_logprobs_B_T
    return LossInputs(
        clean(inputs.logprobs_B_T),
        clean(inputs.old_logprobs_B_T),
        clean(inputs.rollout_logprobs_B_T),
        clean(inputs.advantages_B_T),
        inputs.mask_B_T,
        None if ref is None else clean(ref),
    )


def policy_loss(
    name: str, inputs: LossInputs, options: LossOptions, normalizer: float | None = None
) -> LossResult:
    """The token-mean loss ``name`` (see ``POLICY_LOSSES``), corrected and regularized per ``options``."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown loss {name!r} (known: {', '.join(sorted(POLICY_LOSSES))})")
    inputs = _finite_where_masked(inputs)
    mask = inputs.mask_B_T
    per_token, clipped = POLICY_LOSSES[name](inputs, options)
    per_token = per_token * importance_weights(inputs, options)
    kl_sum = 0.0
    if options.kl_coef and inputs.ref_logprobs_B_T is not None:
        kl = kl_k3(inputs.logprobs_B_T, inputs.ref_logprobs_B_T)
        per_token = per_token + options.kl_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    denominator = float(mask.sum()) if normalizer is None else normalizer
    loss = (per_token * mask).sum() / max(denominator, 1.0)
    return LossResult(loss, float(mask.sum()), float((clipped * mask).sum()), kl_sum)


def importance_stats(
    old_logprobs_B_T: torch.Tensor,
    rollout_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    options: LossOptions,
) -> dict[str, float]:
    """Mean, min and max of the rollout ratio over loss tokens, and the fraction TIS caps / MIS drops."""
    keep = mask_B_T > 0
    if not bool(keep.any()):
        return {}
    ratio = torch.exp(old_logprobs_B_T - rollout_logprobs_B_T)[keep]
    if options.importance == "mis":
        corrected = (ratio < options.mis_low) | (ratio > options.mis_high)
    else:
        corrected = ratio > options.tis_cap
    return {
        "is/ratio_mean": float(ratio.mean()),
        "is/ratio_min": float(ratio.min()),
        "is/ratio_max": float(ratio.max()),
        "is/corrected_frac": float(corrected.float().mean()) if options.importance != "none" else 0.0,
    }
