"""The turn loop: one trajectory, model and env taking turns, exact tokens throughout."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.chat.check import CheckMode
from turnrl.chat.encoder import ChatEncoder, ConversationEncoder
from turnrl.env.base import Env, EnvFactory
from turnrl.env.caps import cap_messages
from turnrl.rewards import RewardContext, Rewards
from turnrl.rollout import env_calls
from turnrl.rollout.control import RolloutControl
from turnrl.rollout.episode import Episode, describe
from turnrl.rollout.limits import Limits
from turnrl.rollout.record import ResponseRecord
from turnrl.types import (
    CURRENT_TURN,
    Engine,
    Generation,
    Message,
    Sample,
    SamplingParams,
    StepResult,
    StopReason,
    Trajectory,
    Turn,
    TurnContext,
)
from turnrl.vision.processor import ImageInput


@dataclass
class RolloutSpec:
    """Everything a trajectory needs besides its sample."""

    env_factory: EnvFactory  # builds a fresh env per trajectory
    engine: Engine  # generates from token ids
    encoder: ChatEncoder  # the model's chat template and tokenizer
    sampling: SamplingParams  # per-turn sampling
    limits: Limits  # stop conditions
    check: CheckMode = "strict"  # sanity check of the final sequence
    rewards: Rewards = field(default_factory=Rewards)  # reward functions by data source
    on_turn: TurnHook | None = None  # called after every turn is appended (per-turn logging)
    control: RolloutControl | None = None  # pause/resume/stop for partial rollout
    mask_offpolicy: bool = False  # mask (0) model tokens sampled by an older policy than the newest
    inference_contexts: bool = False  # record each turn's context as a chat server would render it
    vocab_size: int | None = None  # sampled ids at or above it end the trajectory as engine_error


TurnHook = Callable[[Sample, int, int, Turn], None]
"""Called with (sample, sample_index, turn_index, turn) as each turn completes."""


class EnvFailure(Exception):
    """The env failed more often than the retry budget allows."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class BadReturn(TypeError):
    """An env method returned something of the wrong type."""


def _step_result(value: Any) -> StepResult:
    if not isinstance(value, StepResult):
        raise BadReturn(f"step returned {type(value).__name__}, expected a StepResult")
    if not isinstance(value.reward, int | float) or not math.isfinite(value.reward):
        raise BadReturn(f"step returned the reward {value.reward!r}, expected a finite number")
    return value


def _prompt(value: Any) -> list[Message]:
    if not isinstance(value, list | tuple) or not all(isinstance(m, dict) for m in value):
        raise BadReturn(f"reset returned {type(value).__name__}, expected a list of messages")
    for m in value:
        if not isinstance(m.get("content"), str | list | None):
            kind = type(m.get("content")).__name__
            raise BadReturn(f"reset returned a message whose content is {kind}, expected text or parts")
    return list(value)


async def _call_env(
    env: Env,
    name: str,
    coro_fn: Any,
    limits: Limits,
    failures: dict[str, int],
    check: Callable[[Any], Any],
) -> tuple[Any, int]:
    """Call an env coroutine (``env``'s ``name`` method) with a timeout (``env_calls.call``),
    retrying failures; return (checked result, retries).

    Every failure is counted in ``failures`` by kind (``timeout``, ``blocked_loop``,
    ``bad_return`` or the exception's type).
    """
    errors: list[str] = []
    for attempt in range(limits.max_env_retries_per_turn + 1):
        try:
            return check(await env_calls.call(env, name, coro_fn, limits.env_timeout_s)), attempt
        except TimeoutError:
            kind, message = "timeout", f"timed out after {limits.env_timeout_s}s"
        except env_calls.BlockedLoop as exc:
            kind, message = "blocked_loop", str(exc)
        except BadReturn as exc:
            kind, message = "bad_return", str(exc)
        except Exception as exc:
            kind, message = type(exc).__name__, f"{type(exc).__name__}: {exc}"
        failures[kind] = failures.get(kind, 0) + 1
        errors.append(message)
    raise EnvFailure(f"env failed {len(errors)} times; last: {errors[-1]}", len(errors))


def request_seed(base: int | None, sample: Sample, index: int, turn: int) -> int | None:
    """A distinct, reproducible seed per (sample, index in group, turn), or None when unseeded."""
    if base is None:
        return None
    return zlib.crc32(f"{base}/{sample.id}/{index}/{turn}".encode())


def _budget(record: ResponseRecord, limits: Limits) -> int:
    """Tokens the next generation may still use."""
    left = limits.max_context_tokens - len(record.sequence)
    if limits.max_response_tokens is not None:
        left = min(left, limits.max_response_tokens - len(record.response_ids))
    return left


def _assistant_message(text: str, result: StepResult | None) -> Message:
    message: Message = {"role": "assistant", "content": text}
    calls = (result.info.get("tool_calls") if result else None) or []
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
    return message


def env_seed(base: int | None, sample: Sample, index: int) -> int | None:
    """The env's seed for one trajectory: the row's own, else derived from the run's seed, the
    sample and the index in the group (distinct per trajectory, the same on every rerun)."""
    if sample.seed is not None or base is None:
        return sample.seed
    return zlib.crc32(f"{base}/{sample.id}/{index}/env".encode())


async def run_trajectory(sample: Sample, spec: RolloutSpec, sample_index: int = 0) -> Trajectory:
    """Run one episode of ``sample`` and return its exact token record. Never raises: env and
    engine failures, and bugs, end the trajectory with a stop reason and the error."""
    sample = dataclasses.replace(sample, seed=env_seed(spec.sampling.seed, sample, sample_index))
    ep = Episode(sample, sample_index)
    try:
        env = spec.env_factory(sample)
    except (
        Exception,
        SystemExit,
        KeyboardInterrupt,
    ) as exc:  # a trajectory that cannot start still comes back
        return ep.fail(StopReason.ENV_ERROR, f"env: {describe(exc)}")
    try:
        return await _episode(ep, env, spec)
    except Exception as exc:  # a bug in turnrl or in a hook ends this trajectory only
        return ep.fail(StopReason.INTERNAL_ERROR, f"internal: {describe(exc)}")
    finally:
        await _close(env, spec.limits.env_timeout_s)


async def _episode(ep: Episode, env: Env, spec: RolloutSpec) -> Trajectory:
    """The turns of one episode, top to bottom."""
    # 1. Reset the env: it gives the prompt messages (and the tools, via env.tools).
    prompt = await _reset(ep, env, spec)
    # 2. Encode the prompt once; from here on, tokens are only appended.
    try:
        conv = spec.encoder.conversation(env.tools)
        encoded = conv.prompt(prompt)
    except Exception as exc:  # e.g. the chat template rejects the prompt or the tools
        return ep.fail(StopReason.ENV_ERROR, f"prompt: {describe(exc)}")
    ep.prompt_ids = encoded.ids
    ep.record.start(encoded)
    while ep.running:
        # 3. Generate within the budget; keep the sampled tokens exactly.
        turn = await _model_turn(ep, spec, conv)
        if turn is None:
            break
        # 4. Let the env act on the model's text (tools run here), retrying failures.
        result = await _env_step(ep, env, spec, turn)
        if result is None:
            break
        # 5. Stop when the env is done (its last observation appended only if limits say so)
        #    or the model has used its turns.
        if result.done:
            _final_observation(ep, env, spec, conv, result, turn)
            ep.end(result.stop_reason or StopReason.ENV_DONE)
        elif ep.record.num_model_turns >= spec.limits.max_turns:
            ep.end(StopReason.MAX_TURNS)
        else:
            # 6. Append the observation as delta tokens (mask 0) with its images, unless it
            #    would overflow: then nothing of it is appended and the budget ends the episode.
            _observe(ep, env, spec, conv, result, turn.env_retries)
    # 7. Finalize: trajectory, reward (env still alive), sanity check, metrics.
    return await _finish(ep, env, conv, spec)


async def _reset(ep: Episode, env: Env, spec: RolloutSpec) -> list[Message]:
    """The env's prompt; on failure the sample's, with the episode ended as env_error."""
    try:
        prompt, retries = await _call_env(env, "reset", env.reset, spec.limits, ep.failures, _prompt)
    except EnvFailure as exc:
        ep.env_retries += exc.attempts - 1
        ep.end(StopReason.ENV_ERROR, f"reset: {exc}")
        return list(ep.sample.prompt)
    ep.env_retries += retries
    prompt, cut = cap_messages(prompt, spec.limits.max_observation_chars)
    ep.observations_truncated += cut
    return prompt


async def _model_turn(ep: Episode, spec: RolloutSpec, conv: ConversationEncoder) -> Turn | None:
    """One generation appended to the record; None when it ends the episode."""
    budget = _budget(ep.record, spec.limits)
    if budget <= 0:
        ep.end(StopReason.TOKEN_BUDGET)
        return None
    max_tokens = min(spec.sampling.max_tokens, budget)
    context = _inference_context(ep, conv) if spec.inference_contexts and ep.record.num_model_turns else None
    t0 = time.perf_counter()
    try:
        gen = await _generate(spec, ep.record, ep.sample, ep.index, max_tokens)
    except Exception as exc:
        ep.end(StopReason.ENGINE_ERROR, f"engine: {describe(exc)}")
        return None
    seconds = ep.clock("time/generate", t0)
    bad = _out_of_vocab(gen.token_ids, spec.vocab_size)
    if bad is not None:
        ep.end(StopReason.ENGINE_ERROR, f"engine: sampled token id {bad} outside the vocabulary")
        return None
    text, ep.last_token_text = conv.assistant_text(gen.token_ids)
    turn = ep.record.add_model(gen, text, seconds, _versions(gen, spec.control))
    turn.context_ids = context
    if gen.finish_reason == "stop":
        return turn
    ep.record.messages.append(_assistant_message(text, None))
    if gen.finish_reason == "abort":
        ep.end(StopReason.ABORTED)
    else:
        ep.end(StopReason.TOKEN_BUDGET if max_tokens < spec.sampling.max_tokens else StopReason.LENGTH)
    return None


def _inference_context(ep: Episode, conv: ConversationEncoder) -> list[int] | None:
    """The conversation so far as a chat server would render it for the next turn (history
    re-rendered: past reasoning dropped where the template drops it), when that differs from the
    exact token prefix the engine is given; None when it is the same or cannot be rendered."""
    try:
        ids = conv.inference_context(ep.record.messages, ep.record.images)
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


async def _env_step(ep: Episode, env: Env, spec: RolloutSpec, turn: Turn) -> StepResult | None:
    """The env's answer to a model turn, recorded on the turn; None when the env failed for good."""
    t0 = time.perf_counter()
    try:
        step = lambda: env.step(turn.text)  # noqa: E731
        result, retries = await _call_env(env, "step", step, spec.limits, ep.failures, _step_result)
    except EnvFailure as exc:
        ep.record.messages.append(_assistant_message(turn.text, None))
        ep.env_retries += exc.attempts - 1
        ep.end(StopReason.ENV_ERROR, f"step: {exc}")
        return None
    turn.timings["env"] = ep.clock("time/env", t0)
    ep.env_retries += retries
    turn.reward, turn.env_retries = float(result.reward), retries
    ep.turn_rewards.append(float(result.reward))
    ep.merge_info(result.info)
    turn.info = _jsonable(result.info)
    if result.done and result.observation is not None and not spec.limits.final_observation:
        turn.info["final_observation"] = "dropped"  # said before the turn is reported
    ep.record.messages.append(_assistant_message(turn.text, result))
    if not result.train_turn:  # the env's own loss mask: this turn is context
        span = turn.end - turn.start
        ep.record.loss_mask[turn.start : turn.end] = [0] * span
        ep.record.rollout_logprobs[turn.start : turn.end] = [0.0] * span
        ep.env_masked += span
    _notify(spec, ep)
    return result


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """A step's info as JSON values (what JSON cannot hold, like an image, as its text)."""
    if not info:
        return {}
    try:
        return json.loads(json.dumps(info, default=str))
    except (TypeError, ValueError):  # keys JSON cannot hold, or circular data: kept as text
        return {str(k): repr(v) for k, v in info.items()}


def _final_observation(
    ep: Episode, env: Env, spec: RolloutSpec, conv: ConversationEncoder, result: StepResult, turn: Turn
) -> None:
    """The observation returned with done=True: appended (masked) when limits ask for it and it
    fits, else dropped, said in the turn's info."""
    if result.observation is None or not spec.limits.final_observation:
        return
    if not _observe(ep, env, spec, conv, result, turn.env_retries, final=True):
        turn.info["final_observation"] = "dropped: over the token budget"


def _observe(
    ep: Episode,
    env: Env,
    spec: RolloutSpec,
    conv: ConversationEncoder,
    result: StepResult,
    retries: int,
    final: bool = False,
) -> bool:
    """Append the observation's delta tokens, or end the episode (bad observation, no budget);
    whether it was appended. A ``final`` one that does not fit is left out and ends nothing."""
    t0 = time.perf_counter()
    try:
        messages = env.format_observation(result.observation)
        messages, cut = cap_messages(messages, spec.limits.max_observation_chars)
        ep.observations_truncated += cut
        obs = conv.observation(messages, ep.last_token_text)
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # a bad observation ends this trajectory only
        ep.end(StopReason.ENV_ERROR, f"observation: {describe(exc)}")
        return False
    seconds = ep.clock("time/encode", t0)
    room = _budget(ep.record, spec.limits) - len(obs.ids)
    if room < 0 or (room == 0 and not final):  # a final one may fill the context: nothing follows
        if not final:
            ep.end(StopReason.TOKEN_BUDGET)
        return False
    ep.record.add_env(obs, conv.template.decode(obs.ids), seconds, retries)
    _notify(spec, ep)
    ep.last_token_text = None
    return True


async def _finish(ep: Episode, env: Env, conv: ConversationEncoder, spec: RolloutSpec) -> Trajectory:
    """The trajectory with its reward (scored while the env is alive), sanity check and metrics."""
    _notify(spec, ep)
    traj = ep.trajectory()
    # env.score is env code, bounded by the env timeout; a reward function (a judge) is not
    timeout = spec.limits.env_timeout_s if spec.rewards.fn_for(ep.sample.data_source) is None else None
    try:
        score = lambda: spec.rewards.score(RewardContext(ep.sample, traj, env))  # noqa: E731
        reward = await env_calls.call(env, "score", score, timeout)
    except TimeoutError:
        traj.metrics["reward_error"] = f"score timed out after {timeout}s"
    except Exception as exc:
        traj.metrics["reward_error"] = describe(exc)
    else:
        if math.isfinite(reward):
            traj.reward = reward
        else:  # 0 would be a false signal: the trajectory failed
            traj.stop_reason, traj.error = (
                StopReason.ENV_ERROR,
                f"score: the reward is {reward!r}, not a finite number",
            )
            traj.metrics["reward_error"] = traj.error
    _finish_metrics(traj, conv, ep.last_token_text, spec.check, ep.record.images)
    if spec.mask_offpolicy:
        _mask_offpolicy(traj, ep.record.policy_versions)
    return traj


async def _generate(
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


def _versions(gen: Generation, control: RolloutControl | None) -> list[int]:
    """Per-token policy versions: the engine's, else the control's current version."""
    if gen.versions is not None and len(gen.versions) == len(gen.token_ids):
        return list(gen.versions)
    return [control.policy_version if control else 0] * len(gen.token_ids)


def _join(first: Generation, more: Generation, control: RolloutControl) -> Generation:
    """A generation continued after an abort: tokens, logprobs and versions concatenated."""
    versions = _versions(first, control) + _versions(more, control)
    info = {"resumed": (first.info or {}).get("resumed", 0) + 1}
    return Generation(
        first.token_ids + more.token_ids, first.logprobs + more.logprobs, more.finish_reason, info, versions
    )


def _mask_offpolicy(traj: Trajectory, versions: list[int]) -> None:
    """Mask (0) model tokens sampled by an older policy than the trajectory's newest."""
    sampled = [v for v, m in zip(versions, traj.loss_mask, strict=True) if m]
    newest = max(sampled, default=0)
    masked = 0
    for i, (v, m) in enumerate(zip(versions, traj.loss_mask, strict=True)):
        if m and v < newest:
            traj.loss_mask[i] = 0
            masked += 1
    traj.metrics["tokens/offpolicy_masked"] = masked


def _notify(spec: RolloutSpec, ep: Episode) -> None:
    """Report the turns completed since the last call (a model turn once its env step is done)."""
    record = ep.record
    while record.reported < len(record.turns):
        if spec.on_turn is not None:
            spec.on_turn(ep.sample, ep.index, record.reported, record.turns[record.reported])
        record.reported += 1


async def _close(env: Env, timeout_s: float | None) -> None:
    """Close the env; an error or a hang past ``timeout_s`` never loses a finished trajectory."""
    with contextlib.suppress(Exception):
        await env_calls.call(env, "close", env.close, timeout_s)
    env_calls.release(env)


def _finish_metrics(
    traj: Trajectory,
    conv: ConversationEncoder,
    last_text: str | None,
    mode: CheckMode,
    images: Sequence[ImageInput] = (),
) -> None:
    ends_with_model = bool(traj.turns) and traj.turns[-1].role == "assistant"
    try:
        result = conv.check(
            traj.prompt_ids,
            traj.response_ids,
            traj.messages,
            last_token_text=last_text,
            ends_with_model=ends_with_model,
            mode=mode,
            loss_mask=traj.loss_mask,
            images=images,
        )
    except Exception as exc:  # a template that cannot render the final messages
        traj.metrics["check/error"] = f"{type(exc).__name__}: {exc}"
    else:
        traj.metrics["check/ok"] = result.ok
        traj.metrics["check/mismatches"] = result.mismatches
        traj.metrics["check/expected_diffs"] = sum(1 for h in result.hunks if h.expected)
        if result.hunks:
            traj.info["check"] = result.to_dict()
    traj.metrics["tokens/model"] = sum(traj.loss_mask)
    traj.metrics["tokens/env"] = len(traj.loss_mask) - traj.metrics["tokens/model"]
    traj.metrics["encode/slow_turns"] = conv.slow_turns
