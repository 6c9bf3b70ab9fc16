"""FrozenLake for vision-language models: the board is shown as an image every turn.

Gymnasium's ``FrozenLake-v1`` in ``rgb_array`` mode: the prompt holds the rules and the first frame
(an image part), each model turn names one move (``<action>left</action>``, or just one of the
words left / down / right / up), and each observation is a user message with a short text and the
new frame. Reward 1.0 on reaching the goal; the episode ends on the goal, in a hole, or after
``max_steps`` moves. An answer without a move is answered with a hint and the unchanged board, so
every observation carries exactly one image.

Rows (``FrozenLakeEnv.dataset``) hold a random map drawn from a seed (``generate_random_map``) and the
seed of the episode (which also drives the slipping when ``is_slippery``), so trajectories of a row
play the same lake.
"""

from __future__ import annotations

import os
import random
import re
from typing import Any

from turnrl.env.base import Env
from turnrl.tools import strip_reasoning
from turnrl.types import Message, Sample, StepResult
from turnrl.vision.content import load_image

ACTIONS = ("left", "down", "right", "up")  # gymnasium's action ids 0, 1, 2, 3
SYSTEM_PROMPT = (
    "You are playing FrozenLake. The board is a grid of ice seen from above. You are the small "
    "figure, starting in the top-left cell. Reach the present (the goal) without stepping into a "
    "hole in the ice. Each turn, move one cell with exactly one action: "
    "<action>left</action>, <action>down</action>, <action>right</action> or <action>up</action>."
)
INVALID_HINT = (
    "No valid action found, so you did not move. Reply with <action>left</action>, <action>down</action>, "
    "<action>right</action> or <action>up</action>."
)
_TAG = re.compile(r"<action>\s*([A-Za-z]+)\s*</action>", re.IGNORECASE)
_WORD = re.compile(r"\b(left|down|right|up)\b", re.IGNORECASE)


def parse_action(text: str) -> int | None:
    """The move of a model turn: the last valid ``<action>...</action>``, else the last of the words
    left / down / right / up (any case) in the visible text, else None."""
    visible = strip_reasoning(text)
    tagged = [word.lower() for word in _TAG.findall(visible) if word.lower() in ACTIONS]
    words = tagged or [word.lower() for word in _WORD.findall(visible)]
    return ACTIONS.index(words[-1]) if words else None


def random_map(size: int, p_frozen: float, seed: int) -> list[str]:
    """A ``size`` x ``size`` map with a path from start to goal (gymnasium's generator)."""
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    return list(generate_random_map(size=size, p=p_frozen, seed=seed))


def _image_part(image: Any) -> dict[str, Any]:
    return {"type": "image", "image": load_image(image)}


def with_image(prompt: list[Message], image: Any) -> list[Message]:
    """``prompt`` with ``image`` (PIL or an ``HxWx3`` array) as the first part of its last user message."""
    last = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=None)
    if last is None:
        raise ValueError("the prompt has no user message to show the board in")
    content = prompt[last].get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    return [*prompt[:last], {**prompt[last], "content": [_image_part(image), *parts]}, *prompt[last + 1 :]]


class FrozenLakeEnv(Env):
    """One FrozenLake-v1 episode on the row's map, seen as rgb frames."""

    def __init__(self, sample: Sample, is_slippery: bool = False, max_steps: int = 100) -> None:
        super().__init__(sample)
        self.desc = [str(row) for row in sample.metadata["map"]]
        self.seed = int(sample.metadata.get("seed", 0))
        self.is_slippery = is_slippery
        self.max_steps = max_steps
        self.moves = 0  # valid moves taken
        self.invalid = 0  # turns without a move
        self._env: Any = None

    async def reset(self) -> list[Message]:
        """Make the lake, render the first frame into the prompt."""
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # rgb_array rendering needs no display
        os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
        import gymnasium as gym

        self._env = gym.make(
            "FrozenLake-v1",
            desc=self.desc,
            is_slippery=self.is_slippery,
            render_mode="rgb_array",
            max_episode_steps=self.max_steps,
        )
        self._env.reset(seed=self.seed)
        return with_image(list(self.sample.prompt), self.frame())

    def frame(self) -> Any:
        """The current board as an ``HxWx3`` uint8 array."""
        return self._env.render()

    @property
    def position(self) -> tuple[int, int]:
        """(row, column) of the player."""
        state = int(self._env.unwrapped.s)
        return divmod(state, len(self.desc[0]))

    async def step(self, action: str) -> StepResult:
        """Apply one move; a turn without a move gets a hint and the same board."""
        move = parse_action(action)
        if move is None:
            self.invalid += 1
            return StepResult(self._observation(INVALID_HINT), info={"invalid_actions": 1})
        self.moves += 1
        _, reward, terminated, truncated, _ = self._env.step(move)
        row, col = self.position
        info = {"invalid_actions": 0, "moves": 1}
        if terminated or truncated:
            return StepResult(None, reward=float(reward), done=True, info=info)
        text = f"You chose {ACTIONS[move]}. You are now in row {row + 1}, column {col + 1}. Your next action?"
        return StepResult(self._observation(text), info=info)

    def _observation(self, text: str) -> list[Message]:
        return [{"role": "user", "content": [_image_part(self.frame()), {"type": "text", "text": text}]}]

    async def close(self) -> None:
        """Close the gymnasium env."""
        if self._env is not None:
            self._env.close()
            self._env = None

    @staticmethod
    def dataset(
        size: int = 8, seed: int = 0, map_size: int = 4, p_frozen: float = 0.8
    ) -> list[dict[str, Any]]:
        """``size`` lakes of ``map_size`` x ``map_size``, each from its own seed drawn from ``seed``."""
        rng = random.Random(seed)
        return [_row(i, seed, rng.getrandbits(31), map_size, p_frozen) for i in range(size)]


def _row(index: int, seed: int, game_seed: int, map_size: int, p_frozen: float) -> dict[str, Any]:
    prompt: list[Message] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {
            "role": "user",
            "content": f"Here is the {map_size}x{map_size} lake. What is your first action?",
        },
    ]
    return {
        "id": f"frozen_lake/{seed}/{index}",
        "prompt": prompt,
        "data_source": "frozen_lake",
        "map": random_map(map_size, p_frozen, game_seed),
        "seed": game_seed,
    }
