"""When a trajectory must stop: the ``limits`` section of a run config, and the loop's own."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass


@dataclass(frozen=True, config=ConfigDict(extra="forbid", use_attribute_docstrings=True))
class Limits:
    """When a trajectory must stop, and how hard to try with a failing env."""

    max_turns: Annotated[int, Field(ge=1)] = 8
    """Model turns."""
    max_context_tokens: Annotated[int, Field(ge=16)] = 4096
    """Prompt + response never exceed this."""
    max_response_tokens: Annotated[int | None, Field(ge=1)] = None
    """Model + env tokens after the prompt (None: only the context bounds them)."""
    max_env_retries_per_turn: Annotated[int, Field(ge=0)] = 2
    """Failed env steps retried before the trajectory ends with env_error."""
    env_timeout_s: Annotated[float | None, Field(gt=0)] = 60.0
    """One env step (or reset) longer than this is a failure (None: no timeout)."""
    max_observation_chars: Annotated[int | None, Field(ge=64)] = 200_000
    """An observation text longer than this keeps its start and end, the cut said between (None: no cap)."""
    final_observation: bool = False
    """Append the observation a step returns with done=True (env tokens, mask 0); off: it is dropped,
    and the last model turn's info says so (final_observation: dropped)."""
