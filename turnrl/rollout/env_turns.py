"""The env's side of a turn: reset, step, observation and close, each bounded by the env timeout
(``env_calls``), retried up to ``limits.max_env_retries_per_turn``, and its return checked."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from typing import Any

from turnrl.env.base import Env
from turnrl.env.caps import cap_messages
from turnrl.rollout import env_calls
from turnrl.rollout.spec import Play
from turnrl.support.errors import describe
from turnrl.types import Limits, Message, StepResult, StopReason, Turn


class EnvFailure(Exception):
    """The env failed more often than the retry budget allows."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class BadReturn(TypeError):
    """An env method returned something of the wrong type."""


def step_result(value: Any) -> StepResult:
    """``value`` if it is a StepResult with a finite reward; BadReturn otherwise."""
    if not isinstance(value, StepResult):
        raise BadReturn(f"step returned {type(value).__name__}, expected a StepResult")
    if not isinstance(value.reward, int | float) or not math.isfinite(value.reward):
        raise BadReturn(f"step returned the reward {value.reward!r}, expected a finite number")
    return value


def prompt_messages(value: Any) -> list[Message]:
    """``value`` if it is a list of messages; BadReturn otherwise."""
    if not isinstance(value, list | tuple) or not all(isinstance(m, dict) for m in value):
        raise BadReturn(f"reset returned {type(value).__name__}, expected a list of messages")
    if not value:
        raise BadReturn("reset returned no messages: give the data rows a 'prompt', or build it in reset()")
    for m in value:
        if not isinstance(m.get("content"), str | list | None):
            kind = type(m.get("content")).__name__
            raise BadReturn(f"reset returned a message whose content is {kind}, expected text or parts")
    return list(value)


async def call_with_retries(
    env: Env, name: str, coro_fn: Any, limits: Limits, failures: dict[str, int], check: Callable[[Any], Any]
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
            kind, message = type(exc).__name__, describe(exc)
        failures[kind] = failures.get(kind, 0) + 1
        errors.append(message)
    raise EnvFailure(f"env failed {len(errors)} times; last: {errors[-1]}", len(errors))


def assistant_message(text: str, result: StepResult | None) -> Message:
    """The model turn as a chat message (with the tool calls the env parsed from it)."""
    message: Message = {"role": "assistant", "content": text}
    calls = (result.info.get("tool_calls") if result else None) or []
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
    return message


async def reset(play: Play) -> list[Message]:
    """The env's prompt; on failure the sample's, with the episode ended as env_error."""
    ep, limits = play.ep, play.spec.limits
    try:
        prompt, retries = await call_with_retries(
            play.env, "reset", play.env.reset, limits, ep.failures, prompt_messages
        )
    except EnvFailure as exc:
        ep.env_retries += exc.attempts - 1
        ep.end(StopReason.ENV_ERROR, f"reset: {exc}")
        return list(ep.sample.prompt)
    ep.env_retries += retries
    prompt, cut = cap_messages(prompt, limits.max_observation_chars)
    ep.observations_truncated += cut
    return prompt


async def env_step(play: Play, turn: Turn) -> StepResult | None:
    """The env's answer to a model turn, recorded on the turn; None when the env failed for good."""
    ep, env, limits = play.ep, play.env, play.spec.limits
    t0 = time.perf_counter()
    try:
        step = lambda: env.step(turn.text)  # noqa: E731
        result, retries = await call_with_retries(env, "step", step, limits, ep.failures, step_result)
    except EnvFailure as exc:
        ep.record.messages.append(assistant_message(turn.text, None))
        ep.env_retries += exc.attempts - 1
        ep.end(StopReason.ENV_ERROR, f"step: {exc}")
        return None
    turn.timings["env"] = ep.clock("time/env", t0)
    ep.env_retries += retries
    turn.reward, turn.env_retries = float(result.reward), retries
    ep.turn_rewards.append(float(result.reward))
    ep.merge_info(result.info)
    turn.info = _jsonable(result.info)
    if result.done and result.observation is not None and not limits.final_observation:
        turn.info["final_observation"] = "dropped"  # said before the turn is reported
    ep.record.messages.append(assistant_message(turn.text, result))
    if not result.train_turn:  # the env's own loss mask: this turn is context
        span = turn.end - turn.start
        ep.record.loss_mask[turn.start : turn.end] = [0] * span
        ep.record.rollout_logprobs[turn.start : turn.end] = [0.0] * span
        ep.env_masked += span
    play.notify()
    return result


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """A step's info as JSON values (what JSON cannot hold, like an image, as its text)."""
    if not info:
        return {}
    try:
        return json.loads(json.dumps(info, default=str))
    except (TypeError, ValueError):  # keys JSON cannot hold, or circular data: kept as text
        return {str(k): repr(v) for k, v in info.items()}


def final_observation(play: Play, result: StepResult, turn: Turn) -> None:
    """The observation returned with done=True: appended (masked) when limits ask for it and it
    fits, else dropped, said in the turn's info."""
    if result.observation is None or not play.spec.limits.final_observation:
        return
    if not observe(play, result, turn.env_retries, final=True):
        turn.info["final_observation"] = "dropped: over the token budget"


def observe(play: Play, result: StepResult, retries: int, final: bool = False) -> bool:
    """Append the observation's delta tokens (mask 0) with its images, or end the episode (bad
    observation, no budget); whether it was appended. A ``final`` one that does not fit is left out
    and ends nothing."""
    ep, conv, limits = play.ep, play.encoder, play.spec.limits
    t0 = time.perf_counter()
    try:
        messages = play.env.format_observation(result.observation)
        messages, cut = cap_messages(messages, limits.max_observation_chars)
        ep.observations_truncated += cut
        obs = conv.observation(messages, ep.last_token_text)
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # a bad observation ends this trajectory only
        ep.end(StopReason.ENV_ERROR, f"observation: {describe(exc)}")
        return False
    seconds = ep.clock("time/encode", t0)
    room = budget(play) - len(obs.ids)
    if room < 0 or (room == 0 and not final):  # a final one may fill the context: nothing follows
        if not final:
            ep.end(StopReason.TOKEN_BUDGET)
        return False
    ep.record.add_env(obs, conv.template.decode(obs.ids), seconds, retries)
    play.notify()
    ep.last_token_text = None
    return True


def budget(play: Play) -> int:
    """Tokens the episode may still use (context and response limits)."""
    record, limits = play.ep.record, play.spec.limits
    left = limits.max_context_tokens - len(record.sequence)
    if limits.max_response_tokens is not None:
        left = min(left, limits.max_response_tokens - len(record.response_ids))
    return left


async def close(env: Env, timeout_s: float | None) -> None:
    """Close the env; an error or a hang past ``timeout_s`` never loses a finished trajectory."""
    with contextlib.suppress(Exception):
        await env_calls.call(env, "close", env.close, timeout_s)
    env_calls.release(env)
