"""The turn loop: one trajectory, model and env taking turns, exact tokens throughout."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.chat.check import CheckMode
from turnrl.chat.encoder import ChatEncoder, ConversationEncoder
from turnrl.engines.base import Engine, Generation, SamplingParams
from turnrl.env.base import Env, EnvFactory, StepResult
from turnrl.rewards import RewardContext, RewardFn, compute_reward
from turnrl.rollout.control import RolloutControl
from turnrl.rollout.record import ResponseRecord
from turnrl.types import Message, Sample, StopReason, Trajectory, Turn
from turnrl.vision.processor import ImageInput


@dataclass(frozen=True)
class Limits:
    """When a trajectory must stop, and how hard to try with a failing env."""

    max_turns: int = 8  # model turns
    max_context_tokens: int = 4096  # prompt + response never exceed this
    max_response_tokens: int | None = None  # model + env tokens after the prompt
    max_env_retries_per_turn: int = 2  # failed env steps retried before env_error
    env_timeout_s: float | None = 60.0  # one env step (or reset) longer than this is a failure


@dataclass
class RolloutSpec:
    """Everything a trajectory needs besides its sample."""

    env_factory: EnvFactory  # builds a fresh env per trajectory
    engine: Engine  # generates from token ids
    encoder: ChatEncoder  # the model's chat template and tokenizer
    sampling: SamplingParams  # per-turn sampling
    limits: Limits  # stop conditions
    check: CheckMode = "strict"  # sanity check of the final sequence
    reward_fn: RewardFn | None = None  # overrides routing by data_source
    on_turn: TurnHook | None = None  # called after every turn is appended (per-turn logging)
    control: RolloutControl | None = None  # pause/resume/stop for partial rollout
    mask_offpolicy: bool = False  # mask (0) model tokens sampled by an older policy than the newest


TurnHook = Callable[[Sample, int, int, Turn], None]
"""Called with (sample, sample_index, turn_index, turn) as each turn completes."""


class EnvFailure(Exception):
    """The env failed more often than the retry budget allows."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


async def _call_env(coro_fn: Any, limits: Limits, failures: dict[str, int]) -> tuple[Any, int]:
    """Call an env coroutine with a timeout, retrying failures; return (result, retries).

    Every failure is counted in ``failures`` by kind (``timeout`` or the exception's type).
    """
    errors: list[str] = []
    for attempt in range(limits.max_env_retries_per_turn + 1):
        try:
            return await asyncio.wait_for(coro_fn(), limits.env_timeout_s), attempt
        except TimeoutError:
            kind, message = "timeout", f"timed out after {limits.env_timeout_s}s"
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


async def run_trajectory(sample: Sample, spec: RolloutSpec, sample_index: int = 0) -> Trajectory:
    """Run one episode of ``sample`` and return its exact token record. Never raises for env
    or engine failures: they end the trajectory with a stop reason."""
    try:
        env = spec.env_factory(sample)
    except Exception as exc:  # a trajectory that cannot start still comes back, with its reason
        return failed_trajectory(sample, sample_index, f"env: {type(exc).__name__}: {exc}")
    failures: dict[str, int] = {}
    metrics: dict[str, Any] = {
        "env_retries": 0,
        "env_failures": failures,
        "time/generate": 0.0,
        "time/env": 0.0,
        "time/encode": 0.0,
    }
    record = ResponseRecord()
    turn_rewards: list[float] = []
    error: str | None = None
    info: dict[str, Any] = {}
    try:
        # 1. Reset the env: it gives the prompt messages (and the tools, via env.tools).
        try:
            prompt, retries = await _call_env(env.reset, spec.limits, failures)
            metrics["env_retries"] += retries
        except EnvFailure as exc:
            prompt, error, stop = list(sample.prompt), f"reset: {exc}", StopReason.ENV_ERROR
        # 2. Encode the prompt once; from here on, tokens are only appended.
        try:
            conv = spec.encoder.conversation(env.tools)
            encoded_prompt = conv.prompt(prompt)
        except Exception as exc:  # e.g. the chat template rejects the prompt or the tools
            return failed_trajectory(sample, sample_index, f"prompt: {type(exc).__name__}: {exc}")
        prompt_ids = encoded_prompt.ids
        record.start(encoded_prompt)
        last_token_text: str | None = None
        while error is None:
            # 3. Generate within the budget; keep the sampled tokens exactly.
            budget = _budget(record, spec.limits)
            if budget <= 0:
                stop = StopReason.TOKEN_BUDGET
                break
            max_tokens = min(spec.sampling.max_tokens, budget)
            t0 = time.perf_counter()
            try:
                gen = await _generate(spec, record, sample, sample_index, max_tokens)
            except Exception as exc:
                error, stop = f"engine: {type(exc).__name__}: {exc}", StopReason.ENGINE_ERROR
                break
            gen_s = time.perf_counter() - t0
            metrics["time/generate"] += gen_s
            text, last_token_text = conv.assistant_text(gen.token_ids)
            turn = record.add_model(gen, text, gen_s, _versions(gen, spec.control))
            if gen.finish_reason == "abort":
                record.messages.append(_assistant_message(text, None))
                stop = StopReason.ABORTED
                break
            if gen.finish_reason == "length":
                record.messages.append(_assistant_message(text, None))
                stop = StopReason.TOKEN_BUDGET if max_tokens < spec.sampling.max_tokens else StopReason.LENGTH
                break
            # 4. Let the env act on the model's text (tools run here), retrying failures.
            t0 = time.perf_counter()
            try:
                result, retries = await _call_env(lambda t=text: env.step(t), spec.limits, failures)
            except EnvFailure as exc:
                record.messages.append(_assistant_message(text, None))
                metrics["env_retries"] += exc.attempts - 1
                error, stop = f"step: {exc}", StopReason.ENV_ERROR
                break
            env_s = time.perf_counter() - t0
            metrics["time/env"] += env_s
            metrics["env_retries"] += retries
            turn.timings["env"] = env_s
            turn.reward, turn.env_retries = float(result.reward), retries
            turn_rewards.append(float(result.reward))
            _merge_info(info, result.info)
            record.messages.append(_assistant_message(text, result))
            _notify(spec, sample, sample_index, record)
            # 5. Stop when the env is done or the model has used its turns.
            if result.done:
                stop = result.stop_reason or StopReason.ENV_DONE
                break
            if record.num_model_turns >= spec.limits.max_turns:
                stop = StopReason.MAX_TURNS
                break
            # 6. Append the observation as delta tokens (mask 0) with its images, unless it would
            #    overflow: then nothing of it (tokens, images) is appended.
            t0 = time.perf_counter()
            try:
                obs = conv.observation(env.format_observation(result.observation), last_token_text)
            except Exception as exc:  # a bad observation ends this trajectory, not the run
                error, stop = f"observation: {type(exc).__name__}: {exc}", StopReason.ENV_ERROR
                break
            encode_s = time.perf_counter() - t0
            metrics["time/encode"] += encode_s
            if _budget(record, spec.limits) - len(obs.ids) <= 0:
                stop = StopReason.TOKEN_BUDGET
                break
            record.add_env(obs, conv.template.decode(obs.ids), encode_s, retries)
            _notify(spec, sample, sample_index, record)
            last_token_text = None
        # 7. Finalize: trajectory, reward (env still alive), sanity check, metrics.
        _notify(spec, sample, sample_index, record)
        traj = Trajectory(
            id=f"{sample.id}/{sample_index}",
            group_id=sample.id,
            data_source=sample.data_source,
            prompt_ids=prompt_ids,
            response_ids=record.response_ids,
            loss_mask=record.loss_mask,
            rollout_logprobs=record.rollout_logprobs,
            turns=record.turns,
            messages=record.messages,
            turn_rewards=turn_rewards,
            stop_reason=stop,
            num_turns=record.num_model_turns,
            metrics=metrics,
            sample_index=sample_index,
            error=error,
            info=info,
            policy_versions=record.policy_versions,
            images=[image.image for image in record.images],
            multimodal_inputs=record.multimodal.merge(),
        )
        traj.reward = await _safe_reward(sample, traj, env, spec)
        _finish_metrics(traj, conv, last_token_text, spec.check, record.images)
        if spec.mask_offpolicy:
            _mask_offpolicy(traj, record.policy_versions)
        return traj
    finally:
        await _close(env)


def failed_trajectory(sample: Sample, index: int, error: str) -> Trajectory:
    """The record of a trajectory that failed before its first turn (no env, no prompt)."""
    return Trajectory(
        id=f"{sample.id}/{index}",
        group_id=sample.id,
        data_source=sample.data_source,
        prompt_ids=[],
        response_ids=[],
        loss_mask=[],
        rollout_logprobs=[],
        turns=[],
        messages=list(sample.prompt),
        stop_reason=StopReason.ENV_ERROR,
        sample_index=index,
        error=error,
    )


async def _generate(
    spec: RolloutSpec, record: ResponseRecord, sample: Sample, index: int, max_tokens: int
) -> Generation:
    """One model turn. The live sequence is passed without a copy (O(1) per turn). If a pause
    aborts the generation, the sampled tokens are kept and, on resume, generation continues from
    them, conditioned on them, until the turn is complete."""
    control = spec.control
    if control is not None and control.stopped:
        return Generation([], [], "abort")
    seed = request_seed(spec.sampling.seed, sample, index, record.num_model_turns)
    sampling = dataclasses.replace(spec.sampling, max_tokens=max_tokens, seed=seed)
    session = f"{sample.id}/{index}"
    gen = await spec.engine.generate(record.sequence, sampling, record.images, session=session)
    while gen.finish_reason == "abort" and control is not None and not control.stopped and control.paused:
        await control.wait_running()
        left = max_tokens - len(gen.token_ids)
        if control.stopped or left <= 0:
            break
        resumed = dataclasses.replace(sampling, max_tokens=left, seed=None if seed is None else seed + 1)
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


def _notify(spec: RolloutSpec, sample: Sample, index: int, record: ResponseRecord) -> None:
    """Report the turns completed since the last call (a model turn once its env step is done)."""
    while record.reported < len(record.turns):
        if spec.on_turn is not None:
            spec.on_turn(sample, index, record.reported, record.turns[record.reported])
        record.reported += 1


def _merge_info(info: dict[str, Any], step_info: dict[str, Any]) -> None:
    """Accumulate numeric step info (tool calls, errors) into trajectory info."""
    for key, value in step_info.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            info[key] = info.get(key, 0) + value


async def _safe_reward(sample: Sample, traj: Trajectory, env: Env, spec: RolloutSpec) -> float:
    try:
        return await compute_reward(RewardContext(sample, traj, env), spec.reward_fn)
    except Exception as exc:
        traj.metrics["reward_error"] = f"{type(exc).__name__}: {exc}"
        return 0.0


async def _close(env: Env) -> None:
    with contextlib.suppress(Exception):  # closing must never lose a finished trajectory
        await env.close()


def _check_messages(messages: list[Message]) -> list[Message]:
    """Messages as the template should see them: assistant text holds its tool calls verbatim."""
    return [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]


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
            _check_messages(traj.messages),
            last_text,
            ends_with_model,
            mode,
            traj.loss_mask,
            images,
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
