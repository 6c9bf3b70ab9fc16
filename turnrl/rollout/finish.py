"""The end of an episode: the trajectory scored while the env is alive, checked against a full
re-render of its messages, its metrics, and (if asked) off-policy tokens masked."""

from __future__ import annotations

import math
from collections.abc import Sequence

from turnrl.chat.check import CheckMode
from turnrl.chat.encoder import ConversationEncoder
from turnrl.env.rewards import RewardContext
from turnrl.rollout import env_calls
from turnrl.rollout.spec import Play
from turnrl.support.errors import describe
from turnrl.types import StopReason, Trajectory
from turnrl.vision.processor import ImageInput


async def finish(play: Play) -> Trajectory:
    """The trajectory with its reward (scored while the env is alive), sanity check and metrics."""
    ep, spec = play.ep, play.spec
    play.notify()
    traj = ep.trajectory()
    # env.score is env code, bounded by the env timeout; a reward function (a judge) is not
    timeout = spec.limits.env_timeout_s if spec.rewards.fn_for(ep.sample.data_source) is None else None
    try:
        score = lambda: spec.rewards.score(RewardContext(ep.sample, traj, play.env))  # noqa: E731
        reward = await env_calls.call(play.env, "score", score, timeout)
    except TimeoutError:
        traj.metrics["reward_error"] = f"score timed out after {timeout}s"
    except Exception as exc:
        traj.metrics["reward_error"] = describe(exc)
    else:
        if math.isfinite(reward):
            traj.reward = reward
        else:  # 0 would be a false signal: the trajectory failed
            traj.stop_reason = StopReason.ENV_ERROR
            traj.error = f"score: the reward is {reward!r}, not a finite number"
            traj.metrics["reward_error"] = traj.error
    check_metrics(traj, play.encoder, ep.last_token_text, spec.check, ep.record.images)
    if spec.mask_offpolicy:
        mask_offpolicy(traj, ep.record.policy_versions)
    return traj


def mask_offpolicy(traj: Trajectory, versions: list[int]) -> None:
    """Mask (0) model tokens sampled by an older policy than the trajectory's newest."""
    sampled = [v for v, m in zip(versions, traj.loss_mask, strict=True) if m]
    newest = max(sampled, default=0)
    masked = 0
    for i, (v, m) in enumerate(zip(versions, traj.loss_mask, strict=True)):
        if m and v < newest:
            traj.loss_mask[i] = 0
            masked += 1
    traj.metrics["tokens/offpolicy_masked"] = masked


def check_metrics(
    traj: Trajectory,
    conv: ConversationEncoder,
    last_text: str | None,
    mode: CheckMode,
    images: Sequence[ImageInput] = (),
) -> None:
    """The sanity check of the final sequence against a full re-render (``check/...``) and the
    token counts, in the trajectory's metrics."""
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
        traj.metrics["check/error"] = describe(exc)
    else:
        traj.metrics["check/ok"] = result.ok
        traj.metrics["check/mismatches"] = result.mismatches
        traj.metrics["check/expected_diffs"] = sum(1 for h in result.hunks if h.expected)
        if result.hunks:
            traj.info["check"] = result.to_dict()
    traj.metrics["tokens/model"] = sum(traj.loss_mask)
    traj.metrics["tokens/env"] = len(traj.loss_mask) - traj.metrics["tokens/model"]
    traj.metrics["encode/slow_turns"] = conv.slow_turns
