"""The model's side of a turn: one generation within the token budget, appended exactly as sampled.

A pause (a weight update) aborts the generations in flight; their sampled tokens are kept and, on
resume, generation continues from them, conditioned on them, until the turn is complete, each token
carrying the weight version that sampled it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from turnrl.record.record import ResponseRecord
from turnrl.record.seeds import request_seed
from turnrl.rollout.control import RolloutControl
from turnrl.rollout.env_turns import assistant_message, budget
from turnrl.rollout.spec import Play, RolloutSpec
from turnrl.support.errors import describe
from turnrl.types import CURRENT_TURN, Generation, Sample, StopReason, Turn, TurnContext


async def model_turn(play: Play) -> Turn | None:
    """One generation appended to the record; None when it ends the episode."""
    ep, spec, conv = play.ep, play.spec, play.encoder
    left = budget(play)
    if left <= 0:
        ep.end(StopReason.TOKEN_BUDGET)
        return None
    max_tokens = min(spec.sampling.max_tokens, left)
    context = _inference_context(play) if spec.inference_contexts and ep.record.num_model_turns else None
    t0 = time.perf_counter()
    try:
        gen = await generate(spec, ep.record, ep.sample, ep.index, max_tokens)
    except Exception as exc:
        ep.end(StopReason.ENGINE_ERROR, f"engine: {describe(exc)}")
        return None
    seconds = ep.clock("time/generate", t0)
    bad = _out_of_vocab(gen.token_ids, spec.vocab_size)
    if bad is not None:
        ep.end(StopReason.ENGINE_ERROR, f"engine: sampled token id {bad} outside the vocabulary")
        return None
    text, ep.last_token_text = conv.assistant_text(gen.token_ids)
    turn = ep.record.add_model(gen, text, seconds, versions(gen, spec.control))
    turn.context_ids = context
    if gen.finish_reason == "stop" or (gen.finish_reason == "length" and spec.limits.step_cut_turns):
        return turn  # a cut turn stepped by the env still ends the trajectory after its step (loop)
    ep.record.messages.append(assistant_message(text, None))
    if gen.finish_reason == "abort":
        ep.end(StopReason.ABORTED)
    else:
        turn.reward = 0.0
        ep.turn_rewards.append(0.0)  # one entry per model turn, cut ones included
        ep.end(StopReason.TOKEN_BUDGET if max_tokens < spec.sampling.max_tokens else StopReason.LENGTH)
    return None


def _inference_context(play: Play) -> list[int] | None:
    """The conversation so far as a chat server would render it for the next turn (history
    re-rendered: past reasoning dropped where the template drops it), when that differs from the
    exact token prefix the engine is given; None when it is the same or cannot be rendered."""
    ep = play.ep
    try:
        ids = play.encoder.inference_context(ep.record.messages, ep.record.images)
    except Exception:  # a template that cannot render the history: the exact prefix stands
        ep.info["inference_context_errors"] = ep.info.get("inference_context_errors", 0) + 1
        return None
    if ids == ep.record.sequence:
        return None
    ep.inference_rewrites += 1
    return ids


def _out_of_vocab(ids: Sequence[int], vocab_size: int | None) -> int | None:
    """The first id no model of ``vocab_size`` can sample (negative, or past the vocabulary)."""
    limit = vocab_size if vocab_size is not None else 1 << 31
    return next((t for t in ids if not 0 <= t < limit), None)


async def generate(
    spec: RolloutSpec, record: ResponseRecord, sample: Sample, index: int, max_tokens: int
) -> Generation:
    """One model turn. The live sequence is passed without a copy (O(1) per turn). If a pause
    aborts the generation, the sampled tokens are kept and, on resume, generation continues from
    them, conditioned on them, until the turn is complete."""
    control = spec.control
    if control is not None:
        await control.wait_running()  # a turn never starts during a pause (a weight update)
        if control.stopped:
            return Generation([], [], "abort")
    seed = request_seed(spec.sampling.seed, sample, index, record.num_model_turns)
    sampling = spec.sampling.for_request(max_tokens, seed)
    session = f"{sample.id}/{index}"
    CURRENT_TURN.set(TurnContext(sample, index, record.messages, record.images))
    gen = await spec.engine.generate(record.sequence, sampling, record.images, session=session)
    while gen.finish_reason == "abort" and control is not None and not control.stopped and control.paused:
        await control.wait_running()
        left = max_tokens - len(gen.token_ids)
        if control.stopped or left <= 0:
            break
        resumed = sampling.for_request(left, None if seed is None else seed + 1)
        more = await spec.engine.generate(
            record.sequence + gen.token_ids, resumed, record.images, session=session
        )
        gen = _join(gen, more, control)
    return gen


def versions(gen: Generation, control: RolloutControl | None) -> list[int]:
    """Per-token policy versions: the engine's, else the control's current version."""
    if gen.versions is not None and len(gen.versions) == len(gen.token_ids):
        return list(gen.versions)
    return [control.policy_version if control else 0] * len(gen.token_ids)


def _join(first: Generation, more: Generation, control: RolloutControl) -> Generation:
    """A generation continued after an abort: tokens, logprobs and versions concatenated."""
    joined = versions(first, control) + versions(more, control)
    info = {"resumed": (first.info or {}).get("resumed", 0) + 1}
    return Generation(
        first.token_ids + more.token_ids, first.logprobs + more.logprobs, more.finish_reason, info, joined
    )
