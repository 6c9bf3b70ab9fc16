"""The protocol: every type that crosses a part boundary, declared once.

Data (``Sample``, ``Message``, ``Turn``, ``Trajectory`` with its typed links ``SessionBranch`` and
``AgentRun``, ``StepResult``), the closed choices
(``StopReason``, ``FinishReason``), when a trajectory must stop (``Limits``), what an engine is
asked and answers (``SamplingParams``, ``Generation``), the engine protocol and its optional
capabilities (``Abortable``, ``WeightUpdatable``, ``WeightFollowing``, ``Versioned``, ``Addressed``,
``Served``) with typed helpers that callers use instead of probing attributes (``as_abortable``,
``weight_version``, ...). This module imports nothing of turnrl; the JSON codec of a trajectory
lives in ``turnrl.record.codec``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    Literal,
    NotRequired,
    Protocol,
    TypeAlias,
    TypedDict,
    runtime_checkable,
)

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

if TYPE_CHECKING:
    import torch

SCHEMA_VERSION = 5
"""Version of the trajectory record written to ``trajectories.jsonl`` (bumped on any field change)."""


class Message(TypedDict):
    """A chat message in the OpenAI / Hugging Face format."""

    role: str  # system, user, assistant or tool
    content: NotRequired[Any]  # a string, or a list of parts ({"type": "text" | "image", ...})
    tool_calls: NotRequired[list[dict[str, Any]]]  # assistant: OpenAI-style function calls
    tool_call_id: NotRequired[str]  # tool: the call this result answers
    name: NotRequired[str]  # tool: the tool's name
    reasoning_content: NotRequired[str]  # assistant: reasoning kept apart from the answer


class StopReason(StrEnum):
    """Why a trajectory ended. Every trajectory has exactly one."""

    ENV_DONE = "env_done"  # the environment said the episode is over (terminated)
    NO_TOOL_CALL = "no_tool_call"  # a tool env got an answer without a tool call
    MAX_TURNS = "max_turns"  # the model used all its turns (truncated)
    TOKEN_BUDGET = "token_budget"  # the trajectory's token budget or the context ran out (truncated)
    LENGTH = "length"  # one generation hit its per-turn max_tokens (truncated)
    ENV_ERROR = "env_error"  # the env (reset, step, observation, tools) failed past its retry budget
    ENGINE_ERROR = "engine_error"  # the engine failed and could not be retried
    INTERNAL_ERROR = "internal_error"  # a bug in turnrl or in a hook; the error names it
    ABORTED = "aborted"  # generation was aborted (shutdown, weight update)
    AGENT_DONE = "agent_done"  # a harness run: the agent's process exited 0
    AGENT_ERROR = "agent_error"  # a harness run: the agent exited non-zero, did not start, or never called
    AGENT_TIMEOUT = "agent_timeout"  # a harness run: the agent outran env.timeout_s and was killed
    MODEL_STOP = "model_stop"  # a recorded session's branch: its last reply ended at the model's own stop

    @property
    def truncated(self) -> bool:
        """True when the episode was cut short rather than ended by the task."""
        return self in (StopReason.MAX_TURNS, StopReason.TOKEN_BUDGET, StopReason.LENGTH)


FinishReason = Literal["stop", "length", "abort"]
"""Why one generation ended: a stop token, its max_tokens, or an abort."""


@dataclass
class Sample:
    """One row of the data set, as the rollout sees it."""

    id: str  # stable id of the prompt; trajectories of one prompt share it as group_id
    prompt: list[Message]  # the conversation the model starts from
    data_source: str = "default"  # routes the reward function and, optionally, the env
    tools: list[str] | None = None  # names of the tools this sample may use (None: all the env has)
    tools_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # per tool: create/execute kwargs
    metadata: dict[str, Any] = field(default_factory=dict)  # anything else of the row (ground truth...)
    seed: int | None = None  # the env's seed for this trajectory (set by the rollout per trajectory)
    env: str | None = None  # the env this row plays in: a key of env.routes or an env name (None: the run's)


@dataclass
class Turn:
    """One segment of the response: a model generation or an inserted observation."""

    role: str  # "assistant" for model turns; the chat role(s) of the observation otherwise
    start: int  # first index of this turn in response_ids
    end: int  # one past the last index in response_ids
    text: str  # the segment decoded (model turns: exactly the sampled tokens)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: generate / env / encode
    finish_reason: FinishReason | None = None  # model turns: why the generation ended
    reward: float | None = None  # env reward returned for this model turn's action
    env_retries: int = 0  # failed env attempts before this observation
    # model turns, with inference contexts on: the context a chat server would have given this turn
    # (a fresh render of the conversation so far) where it differs from the exact prefix
    context_ids: list[int] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # model turns: the env step's info (JSON values)
    call: int | None = None  # a recorded session's model turn: its place among the session's calls


@dataclass
class SessionBranch:
    """Where a trajectory sits in a recorded agent session: one branch of the session's tree
    (written by the gateway, read by ``turnrl.gateway.forest`` and the trainer's run counting)."""

    session: str  # the gateway session it was recorded in (one agent run)
    index: int = 0  # its number in the session, in the order branches started (0: the first)
    parent: int | None = None  # the branch it forked from (None: it starts at the prompt)
    reason: str = "first"  # why it started: first, retry, compaction, truncation, edit, subagent, sample
    fork_at: int | None = None  # leading input_ids copied from the parent (None: encoded afresh)
    shared_tokens: int = 0  # leading input_ids equal to the parent's (what a prefix cache reuses)
    trunk_tokens: int = 0  # sampled tokens it holds as context because another branch trains them
    unchosen_tokens: int = 0  # sampled tokens of its replies the agent did not go on from (untrained)


@dataclass
class AgentRun:
    """How the agent run a trajectory came from went (a harness run: its branches share one)."""

    exit_code: int | None  # the agent's exit code (None: it did not start, or was killed)
    seconds: float  # the agent's wall time
    calls: int  # model calls it made
    reward: float | None = None  # the run's reward, its branches' mean: a group's baseline is over runs
    commands: list[dict[str, Any]] = field(default_factory=list)  # what the reward ran in its folder


@dataclass
class Trajectory:
    """The exact token record of one episode, ready for training."""

    id: str  # "<sample id>/<index in group>"
    group_id: str  # the sample id: trajectories of one prompt form a GRPO group
    data_source: str  # copied from the sample
    stop_reason: StopReason  # why the episode ended
    prompt_ids: list[int] = field(default_factory=list)  # the encoded prompt, exactly as sent to the engine
    response_ids: list[int] = field(default_factory=list)  # every token after the prompt, model and env
    loss_mask: list[int] = field(default_factory=list)  # per response token: 1 sampled, 0 env or template
    rollout_logprobs: list[float] = field(default_factory=list)  # per response token (0.0 where mask is 0)
    turns: list[Turn] = field(default_factory=list)  # response segments in order, spans into response_ids
    messages: list[Message] = field(default_factory=list)  # the conversation (prompt + every turn)
    reward: float | None = 0.0  # final scalar reward for the whole trajectory (None: nothing scored it)
    turn_rewards: list[float] = field(default_factory=list)  # env reward per model turn
    num_turns: int = 0  # number of model turns
    metrics: dict[str, Any] = field(default_factory=dict)  # timings, counts, sanity check results
    sample_index: int = 0  # index of this trajectory inside its group
    error: str | None = None  # the last error message, when stop_reason is an error
    info: dict[str, Any] = field(default_factory=dict)  # free-form data from env, tools and users
    exclude: str | None = None  # why training leaves it out (not_reinforced, reward_none, unchosen)
    branch: SessionBranch | None = None  # a recorded session's branch: where it sits in the session
    run: AgentRun | None = None  # an agent harness run's trajectory: how the run went
    policy_versions: list[int] = field(default_factory=list)  # per response token: weight version (-1: env)
    images: list[Any] = field(default_factory=list)  # PIL images in order of appearance (prompt first)
    multimodal_inputs: dict[str, Any] = field(default_factory=dict)  # merged processor outputs (tensors)

    @property
    def truncated(self) -> bool:
        """True when the episode was cut short (max_turns, token_budget, length)."""
        return self.stop_reason.truncated

    @property
    def score(self) -> float:
        """``reward`` as the number training needs; a ValueError names a trajectory nothing scored
        (a recorded session's branch read with ``read_branches``: its reward is None until set)."""
        if self.reward is None:
            raise ValueError(
                f"trajectory {self.id!r} has no reward: nothing scored it (set traj.reward before training)"
            )
        return self.reward

    @property
    def input_ids(self) -> list[int]:
        """The whole sequence: prompt then response."""
        return self.prompt_ids + self.response_ids


Observation: TypeAlias = Any
"""What ``Env.step`` returns for the model to see: a string, a dict, messages...;
``Env.format_observation`` turns it into chat messages."""


@dataclass
class StepResult:
    """The outcome of one env step."""

    observation: Observation  # what the model sees next (ignored when done)
    reward: float = 0.0  # reward for this action
    done: bool = False  # the episode is over
    # free-form; kept on the turn it answers (Turn.info) and its numbers summed into Trajectory.info
    info: dict[str, Any] = field(default_factory=dict)
    stop_reason: StopReason | None = None  # why it is over, when done (default: env_done)
    train_turn: bool = True  # False: the model turn this step answers is context, not trained on


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid", use_attribute_docstrings=True))
class SamplingParams:
    """How to sample one generation; also the ``sampling`` section of a run config."""

    temperature: Annotated[float, Field(ge=0)] = 1.0
    """0 means greedy."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling; 1.0 keeps the whole distribution."""
    top_k: Annotated[int, Field(ge=0)] = 0
    """0 keeps every token."""
    max_tokens: Annotated[int, Field(ge=0)] = 256
    """Per generation; the rollout lowers it to the trajectory's budget left."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens, on top of the model's eos ids."""
    seed: int | None = None
    """This request's seed (a run config sets the run's top-level ``seed`` instead)."""

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with another max_tokens."""
        return replace(self, max_tokens=max_tokens)

    def for_request(
        self, max_tokens: int, seed: int | None, stop_token_ids: tuple[int, ...] | None = None
    ) -> SamplingParams:
        """A copy for one request, without re-validating (the rollout calls it every turn)."""
        new = object.__new__(SamplingParams)
        new.__dict__.update(self.__dict__, max_tokens=max_tokens, seed=seed)
        if stop_token_ids is not None:
            new.__dict__["stop_token_ids"] = stop_token_ids
        return new


@dataclass
class Generation:
    """What the engine sampled for one request.

    ``token_ids`` are exactly the sampled tokens, including the stop token when the
    generation ended on one (``finish_reason == "stop"``). ``logprobs[i]`` is the
    log-probability of ``token_ids[i]`` under ``softmax(logits / temperature)`` over the
    full vocabulary, before top-k / top-p filtering (greedy: temperature 1), which is the
    distribution a trainer recomputes with a forward pass.
    """

    token_ids: list[int]  # sampled token ids, stop token included
    logprobs: list[float]  # one per token in token_ids
    finish_reason: FinishReason  # stop: eos or stop token; length: max_tokens; abort: cut off
    info: dict[str, Any] | None = None  # engine-specific extras (server, timings...)
    versions: list[int] | None = None  # per token: the weight version that sampled it, if known


class EngineError(RuntimeError):
    """The engine failed for a request and retrying will not help."""


@dataclass(frozen=True)
class TurnContext:
    """The conversation behind the token ids an engine is asked to continue, for engines that
    play by messages instead of tokens (a scripted policy). Set by the rollout for each generation
    in ``CURRENT_TURN`` (per asyncio task, so per trajectory); token engines ignore it."""

    sample: Sample  # the trajectory's sample (its metadata: the answer a scripted policy may use)
    sample_index: int  # index in the group
    messages: Sequence[Message]  # the conversation so far (live: read it during the call)
    images: Sequence[Any]  # the images so far, in order of appearance


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid", use_attribute_docstrings=True))
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
    step_cut_turns: bool = False
    """Give a model turn cut at max_tokens to the env's step too (its turn reward, info and per-turn
    hook apply, so a per-turn penalty reaches a model that rambles until it is cut); the trajectory
    still ends there, with ``length``. Off: the cut turn ends the trajectory unstepped and its
    ``turn_rewards`` entry is 0.0."""


CURRENT_TURN: ContextVar[TurnContext | None] = ContextVar("turnrl_current_turn", default=None)
"""The turn being generated in this task, or None outside a rollout."""


class TokenSink(Protocol):
    """Where an engine reports the tokens of a generation as it samples them (a streamed call)."""

    def __call__(self, token_ids: Sequence[int]) -> None:
        """Take the tokens sampled since the last call, in order (called on the caller's event loop)."""
        ...


TOKEN_SINK: ContextVar[TokenSink | None] = ContextVar("turnrl_token_sink", default=None)
"""Set by a caller that streams (the gateway's streamed calls) around one ``generate``: an engine
that samples token by token (the embedded engine, vLLM's) hands it each token as it is sampled,
before ``generate`` returns them all; other engines leave it uncalled, and the caller gets the
tokens at the end. Wrappers (a balancer) pass it through with the task's context."""


@runtime_checkable
class Engine(Protocol):
    """Generates from token ids; many callers may await it concurrently."""

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt_ids``.

        The rollout passes its live token list without copying; the caller appends to it
        after the call returns, so an engine that keeps the ids beyond the call must copy them.
        ``session`` names the trajectory (every turn of it passes the same one), so engines
        behind a load balancer can keep its turns on one server's prefix cache; others ignore it.
        """
        ...

    async def close(self) -> None:
        """Release the engine's resources."""
        ...


@runtime_checkable
class Abortable(Protocol):
    """An engine that can end every generation in flight, keeping what each has sampled."""

    async def abort_all(self) -> None:
        """End every running request with finish_reason "abort"."""
        ...


Weights: TypeAlias = "Mapping[str, torch.Tensor] | str | os.PathLike[str]"
"""New weights: a state dict (in-process engines) or a saved Hugging Face checkpoint folder."""


@runtime_checkable
class WeightUpdatable(Protocol):
    """An engine whose weights can be replaced while it runs."""

    async def update_weights(self, weights: Weights, *, version: int | None = None) -> int:
        """Load new weights; return the new weight version (``version``, else the previous + 1)."""
        ...


@runtime_checkable
class WeightFollowing(Protocol):
    """An engine shared by several processes, whose weights one of them updates (the first training
    rank under torchrun): the others take up the new version once the servers serve it."""

    async def follow_weights(self, version: int) -> None:
        """Stamp tokens with ``version`` from now on, once the servers report serving it."""
        ...


@runtime_checkable
class Versioned(Protocol):
    """An engine whose weights change while it runs (every engine ``update_weights`` works on)."""

    @property
    def weight_version(self) -> int:
        """The weight version it samples with now (0 until the first update)."""
        ...


@runtime_checkable
class Addressed(Protocol):
    """An engine that is a client of one server."""

    @property
    def base_url(self) -> str:
        """The server's address."""
        ...


@runtime_checkable
class Served(Protocol):
    """An engine whose servers turnrl started (and stops when it closes)."""

    @property
    def urls(self) -> list[str]:
        """The servers' addresses."""
        ...


def weight_version(engine: object) -> int:
    """The weight version ``engine`` samples with now; 0 for one whose weights never change."""
    return int(engine.weight_version) if isinstance(engine, Versioned) else 0


def engine_label(engine: object) -> str | None:
    """The address of the server ``engine`` is a client of, if it is one."""
    return engine.base_url if isinstance(engine, Addressed) else None


def server_urls(engine: object) -> list[str]:
    """The addresses of the servers turnrl started for ``engine`` (none: it started none)."""
    return list(engine.urls) if isinstance(engine, Served) else []


def can_abort(engine: object) -> bool:
    """Whether ``engine`` has a callable ``abort_all``."""
    return isinstance(engine, Abortable) and callable(engine.abort_all)


def can_update_weights(engine: object) -> bool:
    """Whether ``engine`` has a callable ``update_weights``."""
    return isinstance(engine, WeightUpdatable) and callable(engine.update_weights)


def as_abortable(engine: object) -> Abortable:
    """The engine, if it can abort everything in flight; a clear TypeError otherwise."""
    if not (isinstance(engine, Abortable) and can_abort(engine)):
        raise TypeError(f"{type(engine).__name__} cannot abort generations in flight (no abort_all)")
    return engine


def as_following(engine: object) -> WeightFollowing:
    """The engine, if it can take up a weight version another process loaded; a clear TypeError otherwise."""
    if not (isinstance(engine, WeightFollowing) and callable(engine.follow_weights)):
        raise TypeError(
            f"{type(engine).__name__} cannot take up weights another process loaded (no follow_weights)"
        )
    return engine


def as_updatable(engine: object) -> WeightUpdatable:
    """The engine, if its weights can be updated; a clear TypeError otherwise."""
    if not (isinstance(engine, WeightUpdatable) and can_update_weights(engine)):
        raise TypeError(f"{type(engine).__name__} cannot update its weights (no update_weights)")
    return engine
