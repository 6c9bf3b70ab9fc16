"""Agent harnesses: an agent that already exists, run as a process per sample and group member, its
model calls served by the gateway, its sessions scored and turned into trajectories to train on.

``HarnessRunner`` serves the rollout engine over HTTP on loopback (``serving``), and for each run
prepares an isolated folder, starts the agent with the session's URL and key (``process``), waits
for it within its timeout, and scores the session's branches with the user's reward (``result``).
It sits above the gateway and below training: it may import ``gateway`` and what the gateway may.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl.harness.result import HarnessResult

if TYPE_CHECKING:
    from turnrl.harness.runner import HarnessRunner

__all__ = ["HarnessResult", "HarnessRunner"]


def __getattr__(name: str) -> Any:
    """``HarnessRunner`` on first use (it needs the gateway's server: ``turnrl[gateway]``)."""
    if name == "HarnessRunner":
        from turnrl.harness.runner import HarnessRunner

        return HarnessRunner
    raise AttributeError(name)
