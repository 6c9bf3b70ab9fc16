"""Any gymnasium env with a discrete action space, played in text or in images.

``render: ansi`` shows the board as text (Taxi, CliffWalking, FrozenLake...; the highlighted cell,
the agent, in parentheses); ``render: rgb_array``
shows it as an image each turn (for VLMs); ``render: obs`` shows the raw observation (Blackjack's
tuple). The model answers with one action: its number in brackets (``[2]``) or, when the config
names the actions (``action_names``), one of the names. Rewards are gymnasium's per step;
``terminated`` ends the episode as ``env_done``, ``truncated`` (the env's own time limit) as
``max_turns``; an answer without a valid action does not step the env and is said so.

Mapping: gymnasium's ``reset(seed)`` takes the trajectory's env seed (``sample.seed``) or the row's
``seed``; ``info`` dicts land in each turn's info; ``render()`` is the observation. What does not
carry over: continuous or composite action spaces (a text action would need a parser of its own).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any, cast

from turnrl.env.base import Env
from turnrl.tools import strip_reasoning
from turnrl.types import Message, Sample, StepResult, StopReason

_NUMBER = re.compile(r"\[\s*(\d+)\s*\]")
_HIGHLIGHT = re.compile(r"\x1b\[4[0-7](?:;\d+)*m(.*?)\x1b\[0m")  # a cell on a colored background
_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def plain_ansi(text: str) -> str:
    """An ansi board as plain text: a highlighted cell (the agent) in parentheses, colors dropped."""
    return _ESCAPE.sub("", _HIGHLIGHT.sub(r"(\1)", text))


class GymnasiumEnv(Env):
    """A gymnasium env (``env_id``) as a multi-turn chat env; see the module doc."""

    def __init__(
        self,
        sample: Sample,
        env_id: str = "FrozenLake-v1",
        render: str = "ansi",
        env_kwargs: dict[str, Any] | None = None,
        action_names: Sequence[str] | None = None,
        instructions: str | None = None,
    ) -> None:
        super().__init__(sample)
        import gymnasium

        self.render_mode = render
        mode = None if render == "obs" else render
        self.env = gymnasium.make(
            sample.metadata.get("env_id", env_id), render_mode=mode, **(env_kwargs or {})
        )
        space = self.env.action_space
        if not isinstance(space, gymnasium.spaces.Discrete):
            raise ValueError(
                f"{env_id}: only discrete action spaces play as text, not {type(space).__name__}"
            )
        self.n = int(space.n)
        self.names = [str(n).lower() for n in action_names] if action_names else None
        if self.names is not None and len(self.names) != self.n:
            raise ValueError(f"{env_id} has {self.n} actions but action_names names {len(self.names)}")
        self.instructions = instructions
        self.steps = 0

    async def reset(self) -> list[Message]:
        """The row's prompt, then the actions and the first observation."""
        seed = self.sample.metadata.get("seed", self.sample.seed)
        observation, _ = await asyncio.to_thread(self.env.reset, seed=None if seed is None else int(seed))
        if self.names:
            how = "Actions: " + ", ".join(f"[{i}] {name}" for i, name in enumerate(self.names)) + "."
        else:
            how = f"Actions: [0] to [{self.n - 1}]."
        rules = f"{self.instructions} " if self.instructions else ""
        return [*self.sample.prompt, self._view(observation, f"{rules}{how} Answer with exactly one action.")]

    async def step(self, action: str) -> StepResult:
        """One gymnasium step for the model's action."""
        chosen = self.parse(action)
        if chosen is None:
            hint = f"No valid action found: answer with one of [0] to [{self.n - 1}]."
            return StepResult(self._text(hint), info={"invalid_actions": 1})
        self.steps += 1
        observation, reward, terminated, truncated, info = await asyncio.to_thread(self.env.step, chosen)
        done = bool(terminated or truncated)
        stop = StopReason.ENV_DONE if terminated else StopReason.MAX_TURNS if truncated else None
        text = f"Reward {float(reward):g}." + (" The episode is over." if done else "")
        step_info = {"action": chosen, "invalid_actions": 0, **_plain(info)}
        return StepResult(self._view(observation, text), float(reward), done, step_info, stop)

    def parse(self, text: str) -> int | None:
        """The last valid ``[k]`` in the visible text, else the last action name it says."""
        visible = strip_reasoning(text).lower()
        numbers = [int(n) for n in _NUMBER.findall(visible) if int(n) < self.n]
        if numbers:
            return numbers[-1]
        if self.names:
            said = [(visible.rfind(name), i) for i, name in enumerate(self.names) if name in visible]
            return max(said)[1] if said else None
        return None

    def format_observation(self, observation: Any) -> list[Message]:
        """The observation message as built."""
        return [observation]

    async def close(self) -> None:
        """Close the gymnasium env."""
        self.env.close()

    def _view(self, observation: Any, text: str) -> Message:
        """A user message showing the state: the ansi board, the frame, or the raw observation."""
        if self.render_mode == "rgb_array":
            from PIL import Image

            frame = Image.fromarray(cast(Any, self.env.render()))
            return {
                "role": "user",
                "content": [{"type": "image", "image": frame}, {"type": "text", "text": text}],
            }
        board = plain_ansi(str(self.env.render())) if self.render_mode == "ansi" else repr(observation)
        return self._text(f"{text}\n{board.rstrip()}")

    def _text(self, text: str) -> Message:
        return {"role": "user", "content": text}

    @staticmethod
    def dataset(size: int = 8, env_id: str = "FrozenLake-v1", seed: int = 0) -> list[dict[str, Any]]:
        """``size`` episodes of ``env_id``, each with its own reset seed."""
        prompt = (
            f"You are playing {env_id}, a gymnasium game. Each turn you see the state and choose one action."
        )
        messages = [{"role": "system", "content": prompt}]
        return [
            {"id": f"{env_id}/{seed}/{i}", "prompt": messages, "env_id": env_id, "seed": seed * 1000 + i}
            for i in range(size)
        ]


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    """gymnasium's info without arrays (numbers and short values only)."""
    out: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, bool | int | float | str):
            out[str(key)] = value
        elif hasattr(value, "item") and getattr(value, "size", 2) == 1:
            out[str(key)] = value.item()
    return out
