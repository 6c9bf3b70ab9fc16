"""Two small OpenEnv environments, served by OpenEnv's own server (``openenv-core``, envs extra).

``python examples/openenv_server.py guess 8000`` serves a number-guessing game in OpenEnv's
classic style (an action with a ``message``, an observation with ``feedback``);
``python examples/openenv_server.py vault 8001`` serves a tool env in OpenEnv's MCP style (FastMCP
tools ``peek(slot)`` and ``open_vault(code)``; opening the vault ends the episode with reward 1).
Each WebSocket session gets its own env; ``OPENENV_MAX_SESSIONS`` (default 64) caps how many run
at once. ``examples/openenv_vault.yaml`` plays the vault through turnrl.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any
from uuid import uuid4

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_SESSIONS = int(os.environ.get("OPENENV_MAX_SESSIONS", "64"))


class GuessAction(Action):
    message: str = Field(..., description="The player's guess, as text")


class GuessObservation(Observation):
    feedback: str = Field(default="", description="What the game says")
    guesses: int = Field(default=0, description="Guesses so far")


class GuessEnvironment(Environment):
    """Guess a number from 1 to 20 in at most 5 guesses; ``seed`` picks it (default 7)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret = 7

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        if kwargs.get("explode"):
            raise RuntimeError("the game board is on fire")
        self.secret = 7 if seed is None else 1 + seed % 20
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(feedback="I picked a number from 1 to 20. Guess it.")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        assert isinstance(action, GuessAction)
        if action.message.startswith("slowly"):  # a step that takes a while (for timeouts)
            time.sleep(2)
        self._state.step_count += 1
        digits = "".join(c for c in action.message if c.isdigit())
        if not digits:
            feedback, done, reward = "That is not a number.", False, 0.0
        elif int(digits) == self.secret:
            feedback, done, reward = "Correct!", True, 1.0
        else:
            feedback = "Higher." if int(digits) < self.secret else "Lower."
            done, reward = False, 0.0
        done = done or self._state.step_count >= 5
        return GuessObservation(feedback=feedback, guesses=self._state.step_count, done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state


class VaultEnvironment(MCPEnvironment):
    """A vault with a 3-digit code, one digit per slot; ``peek`` a slot, ``open_vault`` with the code."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("vault")
        self.code = "123"
        self.opened = False
        self._state = State(episode_id=str(uuid4()), step_count=0)

        @mcp.tool()
        def peek(slot: int) -> str:
            """Show the digit in one slot of the vault's code (slots 0 to 2)."""
            if not 0 <= slot < len(self.code):
                raise ValueError(f"no slot {slot}: slots are 0 to {len(self.code) - 1}")
            return f"slot {slot} holds {self.code[slot]}"

        @mcp.tool()
        def open_vault(code: str) -> str:
            """Try to open the vault with the whole code."""
            self.opened = code == self.code
            return "The vault opens." if self.opened else "Wrong code."

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self.code = str(kwargs.get("code") or ("123" if seed is None else f"{seed % 1000:03d}"))
        self.opened = False
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return Observation()

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        if isinstance(observation, CallToolObservation) and observation.tool_name == "open_vault":
            observation.done = self.opened
            observation.reward = 1.0 if self.opened else 0.0
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


def app(kind: str) -> Any:
    """The FastAPI app of one of the two envs."""
    if kind == "guess":
        return create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=MAX_SESSIONS)
    return create_app(VaultEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=MAX_SESSIONS)


if __name__ == "__main__":
    uvicorn.run(app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
