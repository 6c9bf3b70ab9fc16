"""When a batch of trajectories says the run is broken rather than the model bad.

A dead server, an env that always raises, a chat template that renders nothing: every trajectory
ends in ``engine_error``, ``env_error`` or ``internal_error`` and its reward is 0, which reads
like a model that learns nothing. A rollout, a training step or an evaluation where more than
``fail_fraction`` of the trajectories failed so stops the run (``RunFailed``): one line naming
the most common reason with its first message, what was written kept, no reward reported.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from turnrl.types import StopReason, Trajectory

FAILURES = frozenset(
    {
        StopReason.ENGINE_ERROR,
        StopReason.ENV_ERROR,
        StopReason.INTERNAL_ERROR,
        StopReason.AGENT_ERROR,
        StopReason.AGENT_TIMEOUT,
    }
)
"""Stops that say the infrastructure failed, not the model (for a harness run: the agent's process)."""


class RunFailed(RuntimeError):
    """Too many trajectories failed for infrastructure reasons: the run stops (exit 1)."""


def failure_verdict(trajs: Sequence[Trajectory], fail_fraction: float, what: str) -> str | None:
    """The one line that stops the run when more than ``fail_fraction`` of ``trajs`` failed
    (``what``: "the rollout", "training step 3"...), else None."""
    failed = [t for t in trajs if t.stop_reason in FAILURES]
    if not trajs or len(failed) <= fail_fraction * len(trajs):
        return None
    reasons = Counter(t.stop_reason.value for t in failed)
    reason, count = reasons.most_common(1)[0]
    first = next(t.error for t in failed if t.stop_reason.value == reason) or "no message"
    others = ", ".join(f"{r} x{n}" for r, n in reasons.most_common()[1:])
    others = f" ({others})" if others else ""
    return (
        f"{what} failed: {len(failed)} of {len(trajs)} trajectories ended in an error (more than "
        f"rollout.fail_fraction {fail_fraction:g}); most: {reason} x{count}{others}, first: {first}"
    )


def check_failures(trajs: Sequence[Trajectory], fail_fraction: float, what: str) -> None:
    """Raise ``RunFailed`` with ``failure_verdict``'s line when it has one."""
    verdict = failure_verdict(trajs, fail_fraction, what)
    if verdict is not None:
        raise RunFailed(verdict)
