"""SkyRL-Gym environments (``skyrl-gym``) as turnrl envs, with exact tokens.

A SkyRL env is text in, text out: ``init(prompt) -> (prompt, metadata)``, ``step(action) ->
{observations, reward, done, metadata, postprocessed_action}``, ``close()``, ``get_metrics()``.
Rows in SkyRL's dataset format work as they are: ``env_class`` names the env (else the config's
``env_id``), and ``reward_spec``, ``extra_info`` and every other field reach it as ``extras``.

Mapping: ``init``'s prompt is the prompt; each ``step``'s observations are the messages appended
(delta-encoded, mask 0), its reward the turn's reward (the trajectory's reward is their sum unless
a reward function is routed), ``done`` ends the episode as ``env_done``, ``metadata`` and
``get_metrics()`` land in the turn's and the trajectory's info. What does not carry over:
``postprocessed_action`` (SkyRL may rewrite the model's text, e.g. cut after ``</search>``); turnrl
keeps the sampled tokens exactly, so a rewrite is recorded in the turn's info, not applied.
"""

from __future__ import annotations

import asyncio
from typing import Any

from turnrl.env.base import Env
from turnrl.types import Message, Sample, StepResult, Trajectory


class SkyRLGymEnv(Env):
    """One SkyRL-Gym env per trajectory; see the module doc."""

    def __init__(self, sample: Sample, env_id: str | None = None, env_config: dict[str, Any] | None = None):
        super().__init__(sample)
        import skyrl_gym

        name = sample.metadata.get("env_class") or env_id
        if not name:
            raise ValueError(f"sample '{sample.id}' has no env_class and the config gives no env_id")
        extras = {k: v for k, v in sample.metadata.items() if k != "env_class"}
        self.env = skyrl_gym.make(str(name), env_config=env_config or {}, extras=extras)
        self.name = str(name)

    async def reset(self) -> list[Message]:
        """SkyRL's ``init`` on the row's prompt."""
        prompt, _ = await asyncio.to_thread(self.env.init, [dict(m) for m in self.sample.prompt])
        return list(prompt)

    async def step(self, action: str) -> StepResult:
        """SkyRL's ``step``: its observations, reward and ``done``."""
        out = await asyncio.to_thread(self.env.step, action)
        info: dict[str, Any] = {"skyrl_metadata": out.get("metadata") or {}}
        rewritten = out.get("postprocessed_action")
        if rewritten is not None and rewritten != action:
            info["postprocessed_action"] = rewritten  # recorded, not applied: the tokens stay exact
        observations = list(out.get("observations") or [])
        done = bool(out.get("done"))
        return StepResult(observations or None, float(out.get("reward") or 0.0), done, info)

    def format_observation(self, observation: Any) -> list[Message]:
        """SkyRL's observations are chat messages already."""
        return list(observation or [])

    async def score(self, trajectory: Trajectory) -> float | None:
        """None (the sum of the step rewards), after keeping the env's ``get_metrics()``."""
        metrics = self.env.get_metrics() if hasattr(self.env, "get_metrics") else {}
        trajectory.info.update({f"skyrl/{k}": v for k, v in (metrics or {}).items()})
        return None

    async def close(self) -> None:
        """SkyRL's ``close``."""
        await asyncio.to_thread(self.env.close)
