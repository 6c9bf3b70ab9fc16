"""Guess the number: a multi-turn game with "higher" / "lower" hints, no dependencies.

The secret is drawn from ``random.Random(seed)`` with the row's ``seed``, so every trajectory of a
sample plays the same secret. Reward: ``decay ** (guesses - 1)`` for a correct guess (1.0 at the first
guess, 0.9 at the second with the default decay...), 0.0 when the secret is never found.
"""

from __future__ import annotations

import random
import re
import zlib
from typing import Any

from turnrl.env.base import Env
from turnrl.tools import strip_reasoning
from turnrl.types import Message, Sample, StepResult, Trajectory

SYSTEM_PROMPT = "You are playing a guessing game. Answer each turn with exactly one guess in brackets."
_BRACKETED = re.compile(r"\[\s*(-?\d+)\s*\]")
_INTEGER = re.compile(r"-?\d+")


def parse_guess(text: str) -> int | None:
    """The last ``[n]`` in the visible text, else its last integer, else None."""
    visible = strip_reasoning(text)
    found = _BRACKETED.findall(visible) or _INTEGER.findall(visible)
    return int(found[-1]) if found else None


def secret_for(seed: int, hi: int) -> int:
    """The secret number of a game: uniform in [1, hi] from ``seed``."""
    return random.Random(seed).randint(1, hi)


class GuessNumberEnv(Env):
    """Find a secret integer in [1, hi]; each wrong guess is answered "higher" or "lower"."""

    def __init__(
        self, sample: Sample, hi: int = 20, decay: float = 0.9, max_guesses: int | None = None
    ) -> None:
        super().__init__(sample)
        self.hi = int(sample.metadata.get("hi", hi))  # the row's range wins over the env default
        seed = sample.metadata.get("seed", zlib.crc32(sample.id.encode()))
        self.secret = secret_for(int(seed), self.hi)
        self.decay = decay
        self.max_guesses = max_guesses
        self.guesses = 0
        self.reward = 0.0

    async def step(self, action: str) -> StepResult:
        """Judge one guess: done and rewarded when correct, a hint otherwise."""
        self.guesses += 1
        guess = parse_guess(action)
        valid = guess is not None and 1 <= guess <= self.hi
        info = {"invalid_guesses": int(not valid)}
        if valid and guess == self.secret:
            self.reward = self.decay ** (self.guesses - 1)
            return StepResult(observation=None, reward=self.reward, done=True, info=info)
        if self.max_guesses is not None and self.guesses >= self.max_guesses:
            return StepResult(observation=None, done=True, info=info)
        return StepResult(observation=self._hint(guess if valid else None), info=info)

    def _hint(self, guess: int | None) -> str:
        if guess is None:
            return f"Invalid guess. Reply with one whole number from 1 to {self.hi} in square brackets."
        direction = "Higher" if guess < self.secret else "Lower"
        return f"{direction}. Guess again."

    async def score(self, trajectory: Trajectory) -> float:
        """``decay ** (guesses - 1)`` when the secret was found, else 0.0."""
        return self.reward

    @staticmethod
    def dataset(size: int = 16, hi: int = 20, seed: int = 0) -> list[dict[str, Any]]:
        """``size`` games over [1, hi], each with its own seed drawn from ``seed``."""
        rng = random.Random(seed)
        return [_row(i, hi, rng.getrandbits(32), seed) for i in range(size)]


def demonstration(sample: Sample) -> list[str]:
    """The guesses of a bisection player, to the secret: at most ``ceil(log2(hi + 1))`` turns."""
    hi = int(sample.metadata.get("hi", 20))
    secret = secret_for(int(sample.metadata["seed"]), hi)
    lo, guesses = 1, []
    while True:
        guess = (lo + hi) // 2
        guesses.append(f"[{guess}]")
        if guess == secret:
            return guesses
        lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)


def _row(index: int, hi: int, game_seed: int, seed: int) -> dict[str, Any]:
    prompt: list[Message] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {
            "role": "user",
            "content": f"I am thinking of a whole number from 1 to {hi}. Guess it! Reply with your guess in "
            f"brackets, e.g. [{(hi + 1) // 2}]. After each wrong guess I will say higher or lower.",
        },
    ]
    return {
        "id": f"guess/{seed}/{index}",
        "prompt": prompt,
        "data_source": "guess_number",
        "hi": hi,
        "seed": game_seed,
    }
