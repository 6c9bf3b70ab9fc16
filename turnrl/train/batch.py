"""Trajectories into padded training tensors, one sample per trajectory or one per model turn.

- ``trajectory`` mode: a trajectory is one sample, ``prompt_ids + response_ids``; its model
  tokens are trained on (``loss_mask``), env tokens are context.
- ``turn`` mode (step-wise, ms-swift's ``ThinkingModelTipsScheduler`` style): every model turn
  is its own sample. Its context is exactly what the engine conditioned on when it sampled the
  turn (``prompt_ids + response_ids[:turn.start]``), its trained tokens are that turn's, and its
  advantage is the turn's (with ``grpo``, the trajectory's). Use it where each round should be
  its own sequence, as ms-swift does for templates that drop history; turnrl never re-renders,
  so the context is the exact token prefix the engine saw.
- ``inference`` mode (seed 001's ``use_inference_chat_template``): every model turn is its own
  sample on the context a chat server would have given it, the template's fresh render of the
  conversation so far (recorded per turn by the rollout as ``Turn.context_ids`` where it differs
  from the exact prefix: Qwen3 drops earlier turns' reasoning); what production sees. Its
  rollout logprobs were sampled on the exact prefix, so recomputed old logprobs (the default)
  and the importance correction absorb the difference.

With a token-mean loss the two modes give the same loss and gradient: the same tokens, the same
contexts; ``turn`` mode only recomputes shared prefixes. ``collate`` pads samples into tensors,
``micro_batches`` groups them under a token budget, ``step_prompts`` picks each step's prompts.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from turnrl.train.advantages import TurnAdvantages
from turnrl.types import Message, Sample, Trajectory
from turnrl.vision.buffer import first_images, merge_inputs
from turnrl.vision.content import is_image_part


@dataclass
class TrainSample:
    """One sequence to train on; every list has one entry per token of ``input_ids``."""

    input_ids: list[int]
    loss_mask: list[int]  # 1: trained on (sampled by the model); 0: context
    rollout_logprobs: list[float]  # the engine's logprob of each token (0.0 where mask is 0)
    advantages: list[float]  # the advantage of each token (0.0 where mask is 0)
    trajectory_id: str = ""  # the trajectory it comes from
    turn: int | None = None  # the model turn, in ``turn`` mode
    multimodal: dict[str, torch.Tensor] = field(default_factory=dict)  # its images' inputs (VLMs)


def _token_advantages(traj: Trajectory, turn_advantages: list[float]) -> list[float]:
    """Per response token: the advantage of the model turn it belongs to (0.0 elsewhere)."""
    out = [0.0] * len(traj.response_ids)
    model_turns = [t for t in traj.turns if t.role == "assistant"]
    for turn, advantage in zip(model_turns, turn_advantages, strict=True):
        out[turn.start : turn.end] = [advantage * m for m in traj.loss_mask[turn.start : turn.end]]
    return out


def _trainable(traj: Trajectory) -> bool:
    return bool(traj.prompt_ids) and any(traj.loss_mask)


def trajectory_samples(trajs: Sequence[Trajectory], advantages: TurnAdvantages) -> list[TrainSample]:
    """One sample per trajectory with at least one model token."""
    out = []
    for traj, adv in zip(trajs, advantages, strict=True):
        if not _trainable(traj):
            continue
        context = len(traj.prompt_ids)
        out.append(
            TrainSample(
                input_ids=traj.prompt_ids + traj.response_ids,
                loss_mask=[0] * context + traj.loss_mask,
                rollout_logprobs=[0.0] * context + traj.rollout_logprobs,
                advantages=[0.0] * context + _token_advantages(traj, adv),
                trajectory_id=traj.id,
                multimodal=dict(traj.multimodal_inputs),
            )
        )
    return out


def turn_samples(trajs: Sequence[Trajectory], advantages: TurnAdvantages) -> list[TrainSample]:
    """One sample per model turn with at least one model token: its exact context, then its tokens."""
    out = []
    for traj, adv in zip(trajs, advantages, strict=True):
        if not _trainable(traj):
            continue
        per_token = _token_advantages(traj, adv)
        model_turns = [t for t in traj.turns if t.role == "assistant"]
        seen = images_before_model_turns(traj.messages) if traj.images else [0] * len(model_turns)
        for k, turn in enumerate(model_turns):
            span = slice(turn.start, turn.end)
            if not any(traj.loss_mask[span]):
                continue
            context = len(traj.prompt_ids) + turn.start
            out.append(
                TrainSample(
                    input_ids=traj.prompt_ids + traj.response_ids[: turn.end],
                    loss_mask=[0] * context + traj.loss_mask[span],
                    rollout_logprobs=[0.0] * context + traj.rollout_logprobs[span],
                    advantages=[0.0] * context + per_token[span],
                    trajectory_id=traj.id,
                    turn=k,
                    multimodal=first_images(traj.multimodal_inputs, seen[k]),
                )
            )
    return out


def images_before_model_turns(messages: Sequence[Message]) -> list[int]:
    """Per model turn (assistant message): how many images the messages before it hold, the
    images of that turn's context (images are numbered in order of appearance)."""
    out, seen = [], 0
    for message in messages:
        if message.get("role") == "assistant":
            out.append(seen)
        content = message.get("content")
        if not isinstance(content, str):
            seen += sum(1 for part in content or [] if is_image_part(part))
    return out


def inference_samples(trajs: Sequence[Trajectory], advantages: TurnAdvantages) -> list[TrainSample]:
    """One sample per model turn on the context a chat server would have given it (the turn's
    ``context_ids``: the template's fresh render of the conversation so far, past reasoning
    dropped where the template drops it), else on the exact prefix; then the turn's tokens."""
    out = []
    for traj, adv in zip(trajs, advantages, strict=True):
        model_turns = [t for t in traj.turns if t.role == "assistant"]
        for sample in turn_samples([traj], [adv]):
            context = model_turns[int(sample.turn or 0)].context_ids
            if context is None:
                out.append(sample)
                continue
            exact = len(traj.prompt_ids) + model_turns[int(sample.turn or 0)].start
            out.append(
                replace(
                    sample,
                    input_ids=list(context) + sample.input_ids[exact:],
                    loss_mask=[0] * len(context) + sample.loss_mask[exact:],
                    rollout_logprobs=[0.0] * len(context) + sample.rollout_logprobs[exact:],
                    advantages=[0.0] * len(context) + sample.advantages[exact:],
                )
            )
    return out


SampleBuilder = Callable[[Sequence[Trajectory], TurnAdvantages], list[TrainSample]]
SAMPLE_BUILDERS: dict[str, SampleBuilder] = {
    "trajectory": trajectory_samples,
    "turn": turn_samples,
    "inference": inference_samples,
}


def build_samples(
    mode: str, trajs: Sequence[Trajectory], advantages: TurnAdvantages, loss_turns: str = "all"
) -> list[TrainSample]:
    """The training samples of ``trajs`` in ``mode`` (``trajectory`` or ``turn``); with
    ``loss_turns="last"`` only each trajectory's last model turn is trained on (ms-swift's
    ``loss_scale: last_round``), the earlier ones are context."""
    if mode not in SAMPLE_BUILDERS:
        raise ValueError(f"unknown sample mode {mode!r} (known: {', '.join(sorted(SAMPLE_BUILDERS))})")
    if loss_turns not in ("all", "last"):
        raise ValueError(f"unknown loss_turns {loss_turns!r} (known: all, last)")
    if loss_turns == "last":
        trajs = [last_turn_only(t) for t in trajs]
    return SAMPLE_BUILDERS[mode](trajs, advantages)


def last_turn_only(traj: Trajectory) -> Trajectory:
    """``traj`` with a loss mask on its last model turn only."""
    model_turns = [t for t in traj.turns if t.role == "assistant"]
    if not model_turns:
        return traj
    last = model_turns[-1]
    keep = [int(last.start <= i < last.end) for i in range(len(traj.loss_mask))]
    mask = [m * k for m, k in zip(traj.loss_mask, keep, strict=True)]
    logprobs = [lp * k for lp, k in zip(traj.rollout_logprobs, keep, strict=True)]
    return replace(traj, loss_mask=mask, rollout_logprobs=logprobs)


@dataclass
class Batch:
    """Right-padded ``[B, T]`` tensors of a list of samples."""

    input_ids_B_T: torch.Tensor  # long; padding is pad_id
    attention_mask_B_T: torch.Tensor  # long; 0 on padding
    loss_mask_B_T: torch.Tensor  # float; 0 on context and padding
    rollout_logprobs_B_T: torch.Tensor  # float
    advantages_B_T: torch.Tensor  # float
    old_logprobs_B_T: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # filled by the trainer
    ref_logprobs_B_T: torch.Tensor | None = None  # filled by the trainer when a KL term is on
    multimodal: dict[str, torch.Tensor] = field(default_factory=dict)  # every row's images, row order
    # packed: one row of several samples end to end, each numbered from 0 (None: padded rows)
    position_ids_B_T: torch.Tensor | None = None
    shared_prefix: int = 0  # leading tokens every row holds alike, run through the model once (0: none)

    @property
    def num_tokens(self) -> int:
        """Loss tokens in the batch."""
        return int(self.loss_mask_B_T.sum())

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device``."""
        moved: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        tensors: dict[str, Any] = {k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)}
        return replace(self, **tensors, multimodal={k: v.to(device) for k, v in self.multimodal.items()})


def _pad(
    rows: list[list[float]] | list[list[int]], width: int, value: float, dtype: torch.dtype
) -> torch.Tensor:
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype)


def collate(samples: Sequence[TrainSample], pad_id: int) -> Batch:
    """Right-pad ``samples`` to their longest; old logprobs start as the rollout's."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    width = max(len(s.input_ids) for s in samples)
    rollout = _pad([s.rollout_logprobs for s in samples], width, 0.0, torch.float32)
    return Batch(
        input_ids_B_T=_pad([s.input_ids for s in samples], width, pad_id, torch.long),
        attention_mask_B_T=_pad([[1] * len(s.input_ids) for s in samples], width, 0, torch.long),
        loss_mask_B_T=_pad([s.loss_mask for s in samples], width, 0, torch.float32),
        rollout_logprobs_B_T=rollout,
        advantages_B_T=_pad([s.advantages for s in samples], width, 0.0, torch.float32),
        old_logprobs_B_T=rollout.clone(),
        multimodal=merge_inputs([s.multimodal for s in samples if s.multimodal]),
    )


def pack(samples: Sequence[TrainSample]) -> Batch:
    """One row: the samples end to end, no padding; ``position_ids`` restart at 0 for each, which
    is how the model keeps them apart (a block-diagonal causal mask). A sample's first token is a
    prompt token, never a loss token, so no logprob is taken across a seam."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    if any(s.multimodal for s in samples):
        raise ValueError("samples with images are collated in padded rows, not packed")
    if any(s.loss_mask[0] for s in samples):
        raise ValueError("a packed sample must start with a context token (loss mask 0)")
    row = [collate([s], 0) for s in samples]
    rollout = torch.cat([b.rollout_logprobs_B_T for b in row], 1)
    return Batch(
        input_ids_B_T=torch.cat([b.input_ids_B_T for b in row], 1),
        attention_mask_B_T=torch.cat([b.attention_mask_B_T for b in row], 1),
        loss_mask_B_T=torch.cat([b.loss_mask_B_T for b in row], 1),
        rollout_logprobs_B_T=rollout,
        advantages_B_T=torch.cat([b.advantages_B_T for b in row], 1),
        old_logprobs_B_T=rollout.clone(),
        position_ids_B_T=torch.cat([torch.arange(len(s.input_ids)) for s in samples])[None],
    )


def micro_batches(
    samples: Sequence[TrainSample], max_tokens: int, packed: bool = False, shared: int = 0
) -> list[list[TrainSample]]:
    """Split samples, longest first, into groups that fit ``max_tokens``: their padded size (rows x
    longest), or their total length when ``packed``. Padded samples that begin with the same
    ``shared`` tokens count them once, in the groups that run the fewest tokens
    (``_fewest_tokens``). A sample longer than ``max_tokens`` gets a group of its own."""
    ordered = sorted(samples, key=lambda s: len(s.input_ids), reverse=True)
    if shared and not packed:
        return _fewest_tokens(ordered, max_tokens, shared)
    out: list[list[TrainSample]] = []
    for sample in ordered:
        group = out[-1] if out else []
        if packed:  # total length
            size = sum(len(s.input_ids) for s in group) + len(sample.input_ids)
        else:  # rows x the longest (the group's first)
            size = len(group[0].input_ids) * (len(group) + 1) if group else 0
        if group and size <= max_tokens:
            group.append(sample)
        else:
            out.append([sample])
    return out


def _fewest_tokens(ordered: list[TrainSample], max_tokens: int, shared: int) -> list[list[TrainSample]]:
    """Samples that share ``shared`` leading tokens, longest first, in consecutive groups that run
    the fewest tokens (each group: the prefix once, then rows x its longest's rest) within
    ``max_tokens``: one group would pad every row to the longest, one per row would run the
    prefix every time; the best cut lies between (dynamic programming over the cut points)."""
    rests = [len(s.input_ids) - shared for s in ordered]
    best = [0] + [-1] * len(ordered)  # best[j]: the fewest tokens for the first j samples
    cut = [0] * (len(ordered) + 1)  # where the last group of the best for j begins
    for j in range(1, len(ordered) + 1):
        for i in range(j - 1, -1, -1):  # the group ordered[i:j], longest first
            cost = shared + (j - i) * rests[i]
            if cost > max_tokens and i < j - 1:
                break  # longer groups only grow
            if best[j] < 0 or best[i] + cost < best[j]:
                best[j], cut[j] = best[i] + cost, i
    out: list[list[TrainSample]] = []
    j = len(ordered)
    while j:
        out.insert(0, ordered[cut[j] : j])
        j = cut[j]
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` hold alike."""
    n = min(len(a), len(b))
    differ = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def prefix_clusters(samples: Sequence[TrainSample], min_tokens: int) -> list[tuple[list[TrainSample], int]]:
    """The samples in clusters that begin with the same at least ``min_tokens`` tokens (a GRPO
    group's prompt; in ``turn`` mode also a trajectory's earlier turns; an agent harness run's
    branches, its trunk), each with the number of tokens its members share; a sample that shares
    too little with any other is a cluster of one (sharing 0). In token order, so samples that
    share most are neighbours. A sample joins the cluster before it when that runs fewer tokens
    than starting its own: a cluster of n sharing s runs ``sum(lengths) - (n - 1) s`` tokens, so
    branches that share a long trunk are not merged with another run's at the prompt's length."""
    out: list[tuple[list[TrainSample], int]] = []
    for sample in sorted(samples, key=lambda s: s.input_ids):
        if out:
            cluster, shared = out[-1]
            common = common_prefix(cluster[0].input_ids, sample.input_ids)  # falls as the order moves on
            if common >= min_tokens and (
                len(cluster) == 1 or len(cluster) * common > (len(cluster) - 1) * shared
            ):
                cluster.append(sample)
                out[-1] = (cluster, common)
                continue
        out.append(([sample], 0))
    return out


VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")


def packs(setting: bool | str, model: Any) -> bool:
    """Whether to pack: ``train.pack`` when true or false; ``auto`` packs where the model's attention
    kernel takes variable lengths (flash attention, which reads the seams off ``position_ids``).
    Elsewhere (SDPA, eager: CPUs) a packed row attends over its whole length under a block mask,
    quadratic in the packed length, so length-sorted padded rows are cheaper."""
    if isinstance(setting, bool):
        return setting
    implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
    return implementation.startswith(VARLEN_ATTENTION)


def batches_of(
    samples: Sequence[TrainSample], max_tokens: int, pad_id: int, packed: bool, share_min: int = 0
) -> list[Batch]:
    """The micro-batches of ``samples``: packed rows when ``packed`` (if any sample has images,
    every sample goes in padded rows), else right-padded ones. With ``share_min``, samples that
    begin with the same at least that many tokens go in micro-batches of their own
    (``shared_prefix``: the model runs the prefix once for all of them); when packing, only those
    that run fewer tokens that way than packed (``_shared_batches``)."""
    packed = packed and not any(s.multimodal for s in samples)
    out: list[Batch] = []
    rest = list(samples)
    if share_min:
        out, rest = _shared_batches(
            [s for s in samples if not s.multimodal], max_tokens, pad_id, share_min, packed
        )
        rest += [s for s in samples if s.multimodal]  # images: their own rows
    if packed:
        return out + [pack(part) for part in micro_batches(rest, max_tokens, packed=True)]
    return out + [collate(part, pad_id) for part in micro_batches(rest, max_tokens)]


def _shared_batches(
    samples: Sequence[TrainSample], max_tokens: int, pad_id: int, share_min: int, packed: bool
) -> tuple[list[Batch], list[TrainSample]]:
    """The micro-batches of the samples' clusters (``prefix_clusters``) that share a prefix of at
    least ``share_min`` tokens, and the samples left over (alone, or in a micro-batch that shares
    too little). When ``packed``, a micro-batch shares only if it runs fewer tokens than its rows
    packed end to end: the prefix once and every row padded to the longest, against the rows'
    total length; otherwise its samples are left over to pack."""
    out: list[Batch] = []
    left: list[TrainSample] = []
    for cluster, shared in prefix_clusters(samples, share_min):
        for part in micro_batches(cluster, max_tokens, shared=shared) if len(cluster) > 1 else [cluster]:
            batch = _shared_collate(part, pad_id, share_min)
            rows, width = batch.input_ids_B_T.shape
            run = batch.shared_prefix + rows * (width - batch.shared_prefix)
            if batch.shared_prefix and not (packed and run >= sum(len(s.input_ids) for s in part)):
                out.append(batch)
            else:
                left += part
    return out, left


def _shared_collate(samples: list[TrainSample], pad_id: int, share_min: int) -> Batch:
    """Padded rows marked with the prefix they all share (at least one token of each row left to
    run after it), if that is at least ``share_min`` tokens and there are two rows or more."""
    first = samples[0].input_ids
    shared = min(len(s.input_ids) - 1 for s in samples)
    for s in samples[1:]:
        shared = min(shared, common_prefix(first, s.input_ids))
    batch = collate(samples, pad_id)
    return replace(batch, shared_prefix=shared) if len(samples) > 1 and shared >= share_min else batch


def step_prompts(samples: list[Sample], per_step: int, step: int, seed: int) -> list[Sample]:
    """The prompts of ``step``: its slice of its epoch's shuffle (an epoch's leftovers are skipped)."""
    if per_step > len(samples):
        raise ValueError(f"train.prompts_per_step is {per_step} but the data has only {len(samples)} prompts")
    epoch, slot = divmod(step, len(samples) // per_step)
    order = list(range(len(samples)))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return [samples[i] for i in order[slot * per_step : (slot + 1) * per_step]]


def step_seed(seed: int, step: int) -> int:
    """The base sampling seed of a step's rollout."""
    return zlib.crc32(f"{seed}/step/{step}".encode())


def unexpected_versions(trajs: Sequence[Trajectory], current: int, max_staleness: int) -> list[Trajectory]:
    """The trajectories with a model token not sampled by an allowed weight version:
    ``current - max_staleness`` up to ``current`` (the version the engine serves now)."""
    low = current - max_staleness
    return [
        traj
        for traj in trajs
        if any(
            (v < low or v > current) for v, m in zip(traj.policy_versions, traj.loss_mask, strict=False) if m
        )
    ]
