"""Single-player textarena games as envs, each observation holding only what is new.

textarena's default wrappers return the whole game log at every step. Appending that would repeat the
history in every observation, so the env appends only the part after the previous observation (when the
previous one is a prefix of the new one; the whole new observation otherwise). It also drops the echo of
the model's own move that leads the new part, since the move is already in the conversation.

Games that run offline with textarena 0.7.4: 2048, Bandit, Blackjack, Countdown, Crosswords, Cryptarithm,
FifteenPuzzle, FrozenLake, GuessTheNumber, LightsOut, LogicPuzzle, Mastermind, Minesweeper, PegJump,
RushHour, Secretary, Set, Slitherlink, Sokoban, Sudoku, ThreeCardMonte, TowerOfHanoi (all ``-v0``).
Word games (Wordle, Hangman, WordLadder, SpellingBee...) need NLTK corpora; TwentyQuestions and GuessWho
need an OpenRouter key.

textarena draws from the global ``random`` module; every game call here runs with the episode's own
``random`` state swapped in, so concurrent episodes neither disturb each other nor the process.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from turnrl.env.base import Env
from turnrl.types import Message, Sample, StepResult, Trajectory

PLAYER_ID = 0


def new_part(previous: str, current: str) -> str:
    """``current`` less its ``previous`` prefix; all of ``current`` when it does not extend ``previous``."""
    return current[len(previous) :] if current.startswith(previous) else current


def drop_echo(delta: str, action: str, role: str = "Player") -> str:
    """``delta`` without the leading ``[role] <action>`` line textarena echoes back after a move."""
    for move in (action, f"[{action}]"):  # the action wrapper brackets moves that have no brackets
        echo = f"\n[{role}] {move}"
        if delta.startswith(echo):
            return delta[len(echo) :]
    return delta


class TextArenaEnv(Env):
    """A single-player textarena game (``env_id``, or the row's ``env_id``) played turn by turn."""

    def __init__(
        self,
        sample: Sample,
        env_id: str = "GuessTheNumber-v0",
        env_kwargs: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        echo_actions: bool = False,
        partial_credit: bool = False,
    ) -> None:
        super().__init__(sample)
        self.env_id = str(sample.metadata.get("env_id", env_id))
        self.env_kwargs = dict(env_kwargs or {})  # override the registered game's kwargs (max_turns...)
        self.system_prompt = system_prompt
        self.echo_actions = echo_actions  # keep textarena's echo of the model's move in observations
        # textarena pays a game lost by an invalid move its "percentage completion" (GuessTheNumber:
        # up to ~0.9); a lost game scores 0.0 here unless partial_credit keeps textarena's value
        self.partial_credit = partial_credit
        self.seed = int(sample.metadata.get("seed", zlib.crc32(sample.id.encode())))
        self.reward = 0.0
        self.game_info: dict[str, Any] = {}
        self._game: Any = None
        self._last = ""
        self._random_state: Any = None

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        """Run game code with this episode's ``random`` state, then put the process's state back."""
        outer = random.getstate()
        if self._random_state is not None:
            random.setstate(self._random_state)
        try:
            yield
        finally:
            self._random_state = random.getstate()
            random.setstate(outer)

    async def reset(self) -> list[Message]:
        """Make and seed the game; its opening observation is the prompt."""
        import textarena as ta

        with self._own_random():
            self._game = ta.make(self.env_id, **self.env_kwargs)
            self._game.reset(num_players=1, seed=self.seed)
            _, self._last = self._game.get_observation()
        messages: list[Message] = [{"role": "user", "content": self._last.strip()}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def step(self, action: str) -> StepResult:
        """Play the model's move; the observation is what the game added since the last one."""
        with self._own_random():
            done, _ = self._game.step(action)
            if done:
                return self._finish()
            _, observation = self._game.get_observation()
        delta = new_part(self._last, observation)
        self._last = observation
        if not self.echo_actions:
            delta = drop_echo(delta, action, self._role())
        return StepResult(observation=delta.strip() or "(the game said nothing new)")

    def _finish(self) -> StepResult:
        """Read textarena's result: the player's reward and the game's reason."""
        rewards, game_info = self._game.close()
        self.game_info = dict((game_info or {}).get(PLAYER_ID, {}))
        textarena_reward = float((rewards or {}).get(PLAYER_ID, 0.0))
        lost = bool(self.game_info.get("invalid_move"))
        self.reward = 0.0 if lost and not self.partial_credit else textarena_reward
        info = {
            "invalid_move": int(lost),
            "reason": self.game_info.get("reason"),
            "textarena_reward": textarena_reward,
        }
        return StepResult(observation=None, reward=self.reward, done=True, info=info)

    def _role(self) -> str:
        """The name textarena gives the player in its logs."""
        state = getattr(self._game, "state", None)
        roles = getattr(state, "role_mapping", None) or {}
        return str(roles.get(PLAYER_ID, f"Player {PLAYER_ID}"))

    async def score(self, trajectory: Trajectory) -> float:
        """textarena's reward when the game ended, else 0.0 (the turn limit cut it short)."""
        return self.reward

    async def close(self) -> None:
        """Drop the game."""
        self._game = None

    @staticmethod
    def dataset(env_id: str = "GuessTheNumber-v0", size: int = 8, seed: int = 0) -> list[dict[str, Any]]:
        """``size`` games of ``env_id``, each with its own seed; the game writes the real prompt at reset."""
        rng = random.Random(seed)
        return [
            {
                "id": f"{env_id}/{seed}/{i}",
                "prompt": f"Play the textarena game {env_id}.",
                "data_source": env_id,
                "env_id": env_id,
                "seed": rng.getrandbits(32),
            }
            for i in range(size)
        ]
