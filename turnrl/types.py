"""Protocol types shared by every part: samples, turns, trajectories, stop reasons."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

Message = dict[str, Any]
"""A chat message in the OpenAI / Hugging Face format: ``{"role": ..., "content": ...}``."""


class StopReason(StrEnum):
    """Why a trajectory ended. Every trajectory has exactly one."""

    ENV_DONE = "env_done"  # the environment said the episode is over (terminated)
    NO_TOOL_CALL = "no_tool_call"  # a tool env got an answer without a tool call
    MAX_TURNS = "max_turns"  # the model used all its turns (truncated)
    TOKEN_BUDGET = "token_budget"  # the trajectory's token budget or the context ran out (truncated)
    LENGTH = "length"  # one generation hit its per-turn max_tokens (truncated)
    ENV_ERROR = "env_error"  # the env failed more often than its retry budget allows
    ENGINE_ERROR = "engine_error"  # the engine failed and could not be retried
    ABORTED = "aborted"  # generation was aborted (shutdown, weight update)

    @property
    def truncated(self) -> bool:
        """True when the episode was cut short rather than ended by the task."""
        return self in (StopReason.MAX_TURNS, StopReason.TOKEN_BUDGET, StopReason.LENGTH)


@dataclass
class Sample:
    """One row of the data set, as the rollout sees it."""

    id: str  # stable id of the prompt; trajectories of one prompt share it as group_id
    prompt: list[Message]  # the conversation the model starts from
    data_source: str = "default"  # routes the reward function and, optionally, the env
    tools: list[str] | None = None  # names of the tools this sample may use (None: all the env has)
    tools_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # per tool: create/execute kwargs
    metadata: dict[str, Any] = field(default_factory=dict)  # anything else of the row (ground truth...)


@dataclass
class Turn:
    """One segment of the response: a model generation or an inserted observation."""

    role: str  # "assistant" for model turns; the chat role(s) of the observation otherwise
    start: int  # first index of this turn in response_ids
    end: int  # one past the last index in response_ids
    text: str  # the segment decoded (model turns: exactly the sampled tokens)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: generate / env / encode
    finish_reason: str | None = None  # model turns: stop / length / abort
    reward: float | None = None  # env reward returned for this model turn's action
    env_retries: int = 0  # failed env attempts before this observation


@dataclass
class Trajectory:
    """The exact token record of one episode, ready for training."""

    id: str  # "<sample id>/<index in group>"
    group_id: str  # the sample id: trajectories of one prompt form a GRPO group
    data_source: str  # copied from the sample
    prompt_ids: list[int]  # the encoded prompt, exactly as sent to the engine
    response_ids: list[int]  # every token after the prompt: model and env tokens interleaved
    loss_mask: list[int]  # per response token: 1 sampled by the model, 0 inserted by env or template
    rollout_logprobs: list[float]  # per response token: sampled logprob (0.0 where mask is 0)
    turns: list[Turn]  # response segments in order, with spans into response_ids
    messages: list[Message]  # the conversation as chat messages (prompt + every turn)
    reward: float = 0.0  # final scalar reward for the whole trajectory
    turn_rewards: list[float] = field(default_factory=list)  # env reward per model turn
    stop_reason: StopReason = StopReason.ENV_DONE  # why the episode ended
    num_turns: int = 0  # number of model turns
    metrics: dict[str, Any] = field(default_factory=dict)  # timings, counts, sanity check results
    sample_index: int = 0  # index of this trajectory inside its group
    error: str | None = None  # the last error message, when stop_reason is an error
    info: dict[str, Any] = field(default_factory=dict)  # free-form data from env and tools
    policy_versions: list[int] = field(default_factory=list)  # per response token: weight version (-1: env)
    images: list[Any] = field(default_factory=list)  # PIL images in order of appearance (prompt first)
    multimodal_inputs: dict[str, Any] = field(default_factory=dict)  # merged processor outputs (tensors)

    @property
    def truncated(self) -> bool:
        """True when the episode was cut short (max_turns, token_budget, length)."""
        return self.stop_reason.truncated

    @property
    def input_ids(self) -> list[int]:
        """The whole sequence: prompt then response."""
        return self.prompt_ids + self.response_ids

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; the stop reason is its string value. Images become PNG data URLs
        in ``images``, and message image parts ``{"type": "image", "image_index": k}``; the
        training tensors are left out (``turnrl.vision`` recomputes them from the images)."""
        images, self.images = self.images, []
        tensors, self.multimodal_inputs = self.multimodal_inputs, {}
        try:
            out = asdict(self)
        finally:
            self.images, self.multimodal_inputs = images, tensors
        del out["multimodal_inputs"]
        out["stop_reason"] = self.stop_reason.value
        if images:
            from turnrl.vision.content import data_url, messages_to_json

            out["messages"] = messages_to_json(self.messages, images)
            out["images"] = [data_url(image) for image in images]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """The inverse of ``to_dict`` (images come back as PIL images)."""
        data = dict(data)
        data["stop_reason"] = StopReason(data["stop_reason"])
        data["turns"] = [Turn(**t) for t in data.get("turns", [])]
        if data.get("images"):
            from turnrl.vision.content import load_image, messages_from_json

            data["images"] = [load_image(url) for url in data["images"]]
            data["messages"] = messages_from_json(data["messages"], data["images"])
        return cls(**data)
