"""What a trainer's agent-loop hook (verl, slime) takes from a turnrl config.

The trainer owns the model, the data, the inference servers and the sampling distribution; a turnrl
config used with it keeps the rest. ``load_settings(path, overrides)`` reads a ``turnrl rollout`` or
``turnrl train`` config and keeps ``env``, ``chat``, ``sampling``, ``limits`` and ``rewards``; every
other key (model, data, engine, rollout, train...) is the trainer's business and is ignored.

Length limits: the trainer's budget (its response length, its context) applies; a limit the turnrl
config sets explicitly can only tighten it. ``sampling.max_tokens`` caps one model turn when the
config sets it, else one turn may use the whole response budget. Temperature, top-p and top-k come
from the trainer, since its loss is computed under the distribution it asked for.

Rewards: ``tracked_reward`` computes turnrl's final reward (the routed reward function, else the
env's ``score``, else the sum of step rewards) and remembers whether one was really computed;
``computed_reward`` gives it back, or None when the env gave nothing (no reward function, no score,
only zero step rewards), so the trainer's own reward function scores that trajectory instead.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from turnrl.app.parts import build_env_factory
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import ChatConfig, EnvConfig, first_error, read_yaml_mapping
from turnrl.data import sample_from_row
from turnrl.env.base import EnvFactory
from turnrl.env.rewards import RewardContext, RewardFn, Rewards
from turnrl.support.imports import import_object
from turnrl.types import Limits, Sample, SamplingParams, Trajectory
from turnrl.vision.processor import VisionProcessor

ENV_FIELD = "turnrl_env"  # a data row's own env: a registered name, module:Class, or {name, kwargs}
REWARD_SOURCE = "reward_source"  # trajectory.metrics key: reward_fn / env_score / step_rewards
NO_LIMIT = 2**62  # a context limit nobody set


class SettingsError(ValueError):
    """A turnrl config (or an override, or a row's env) that cannot be used; the message says why."""


class AgentSettings(BaseModel):
    """The part of a turnrl config that a trainer integration uses."""

    model_config = ConfigDict(extra="forbid")

    env: EnvConfig | None = None  # None: every data row names its env in ENV_FIELD
    chat: ChatConfig = Field(default_factory=ChatConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)  # only max_tokens is used, if set
    limits: Limits = Field(default_factory=Limits)
    rewards: dict[str, str] = Field(default_factory=dict)  # data_source -> "module:function"
    _given: dict[str, frozenset[str]] = PrivateAttr(default_factory=dict)
    _rewards: Rewards | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_given(cls, data: Any, handler: Any) -> AgentSettings:
        settings: AgentSettings = handler(data)
        if isinstance(data, Mapping):
            settings._given = {k: frozenset(v) for k, v in data.items() if isinstance(v, Mapping)}
        return settings

    def given(self, section: str, key: str) -> bool:
        """Whether the config set ``section.key`` explicitly (else the trainer's value rules)."""
        return key in self._given.get(section, frozenset())

    def reward_routing(self) -> Rewards:
        """The settings' reward functions, each noting where a reward came from (``tracked_reward``);
        imported once per settings object (the hooks call this for every trajectory)."""
        if self._rewards is None:
            by_source = {src: import_object(fn, f"reward for {src!r}") for src, fn in self.rewards.items()}
            self._rewards = Rewards(default=tracked_reward(by_source))
        return self._rewards


_LOCK = threading.Lock()
_SETTINGS: dict[str, AgentSettings] = {}
_FACTORIES: dict[str, EnvFactory] = {}
_ENCODERS: dict[tuple[int, int, str], tuple[Any, VisionProcessor | None, ChatEncoder]] = {}
_VISIONS: dict[tuple[int, int], tuple[Any, Any, VisionProcessor]] = {}


def plain(value: Any) -> Any:
    """Numpy arrays and scalars (how trainers hand over row fields) as plain Python values."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and type(value).__module__ == "numpy":
        return plain(tolist())
    return value


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, mappings merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    data = read_yaml_mapping(path, SettingsError)
    return {k: v for k, v in data.items() if k in AgentSettings.model_fields}


def load_settings(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> AgentSettings:
    """Settings from a turnrl config file (trainer-owned keys ignored) with ``overrides`` on top
    (these may hold only settings keys): an ``env`` there replaces the config's env whole, the other
    sections are merged key by key. Cached: each (path, overrides) is read once per process."""
    overrides = plain(dict(overrides or {}))
    key = json.dumps([os.fspath(path) if path else None, overrides], sort_keys=True, default=str)
    with _LOCK:
        if key in _SETTINGS:
            return _SETTINGS[key]
    data = _merge(_read(path) if path else {}, {k: v for k, v in overrides.items() if k != "env"})
    if "env" in overrides:  # another env: its kwargs are not the config env's
        data["env"] = overrides["env"]
    try:
        settings = AgentSettings.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(f"turnrl settings: {first_error(exc, data)}") from None
    settings.reward_routing()  # import the reward functions now: a bad one fails here, named
    with _LOCK:
        return _SETTINGS.setdefault(key, settings)


def env_factory(settings: AgentSettings, row_env: Any = None) -> EnvFactory:
    """The env of a row: its own ``turnrl_env`` when it has one, else the settings' env (cached)."""
    if row_env is not None:
        try:
            config = (
                EnvConfig(name=row_env) if isinstance(row_env, str) else EnvConfig.model_validate(row_env)
            )
        except ValidationError as exc:
            raise SettingsError(f"data row field {ENV_FIELD!r}: {first_error(exc, row_env)}") from None
    elif settings.env is not None:
        config = settings.env
    else:
        raise SettingsError(f"no env: set env in the turnrl config or a {ENV_FIELD!r} field in each data row")
    key = config.model_dump_json()
    with _LOCK:
        if key in _FACTORIES:
            return _FACTORIES[key]
    factory = build_env_factory(config)
    with _LOCK:
        return _FACTORIES.setdefault(key, factory)


def vision_processor(image_processor: Any, tokenizer: Any) -> VisionProcessor:
    """One VisionProcessor per (image processor, tokenizer) in this process: a trainer hands the same
    processor to every agent loop, so their chat encoders (and template probes) are shared too."""
    key = (id(image_processor), id(tokenizer))
    with _LOCK:
        cached = _VISIONS.get(key)
        if cached is None or cached[0] is not image_processor or cached[1] is not tokenizer:
            cached = (image_processor, tokenizer, VisionProcessor.from_tokenizer(image_processor, tokenizer))
            _VISIONS[key] = cached
        return cached[2]


def chat_encoder(
    tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None, vision: VisionProcessor | None = None
) -> ChatEncoder:
    """One ChatEncoder per (tokenizer, template kwargs, image processor) in this process, so each
    template is probed once; ``vision`` for a vision-language model."""
    kwargs = plain(dict(template_kwargs or {}))
    key = (id(tokenizer), id(vision), json.dumps(kwargs, sort_keys=True, default=str))
    with _LOCK:
        cached = _ENCODERS.get(key)
        if cached is not None and cached[0] is tokenizer and cached[1] is vision:
            return cached[2]
        encoder = ChatEncoder(tokenizer, kwargs, vision)
        _ENCODERS[key] = (tokenizer, vision, encoder)
        return encoder


def trainer_limits(
    settings: AgentSettings, *, max_response_tokens: int, max_context_tokens: int | None = None
) -> Limits:
    """The trainer's length budget, tightened by what the turnrl config sets explicitly."""
    mine = settings.limits
    response = int(max_response_tokens)
    if settings.given("limits", "max_response_tokens") and mine.max_response_tokens is not None:
        response = min(response, mine.max_response_tokens)
    context = int(max_context_tokens) if max_context_tokens is not None else NO_LIMIT
    if settings.given("limits", "max_context_tokens"):
        context = min(context, mine.max_context_tokens)
    return Limits(
        max_turns=mine.max_turns,
        max_context_tokens=context,
        max_response_tokens=response,
        max_env_retries_per_turn=mine.max_env_retries_per_turn,
        env_timeout_s=mine.env_timeout_s,
    )


def turn_max_tokens(settings: AgentSettings, response_budget: int) -> int:
    """Tokens one model turn may sample: the config's ``sampling.max_tokens`` if set, else the budget."""
    if settings.given("sampling", "max_tokens"):
        return max(1, min(settings.sampling.max_tokens, response_budget))
    return max(1, response_budget)


def trainer_sample(prompt: Any, fields: Mapping[str, Any], default_id: str) -> Sample:
    """A turnrl Sample from a trainer's row: ``prompt`` (chat messages or a string); ``id``,
    ``data_source``, ``tools``, ``tools_kwargs`` when the row has them; every other field in
    ``metadata``, and the keys of ``extra_info`` (verl's) and ``metadata`` (slime's) too, where no
    field of the same name exists."""
    row = {k: v for k, v in plain(dict(fields)).items() if k != ENV_FIELD}
    row["prompt"] = plain(prompt)
    row.setdefault("id", default_id)
    if row.get("id") is None:
        row["id"] = default_id
    sample = sample_from_row(row, 0, "the trainer's data")
    extra = row.get("extra_info")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            sample.metadata.setdefault(key, value)
    return sample


def tracked_reward(by_source: Mapping[str, RewardFn]) -> RewardFn:
    """turnrl's final reward (``by_source``'s function, else env score, else sum of step rewards),
    noting in ``metrics[REWARD_SOURCE]`` where it came from; nothing is noted when the env gave nothing."""

    async def reward(ctx: RewardContext) -> float:
        traj = ctx.trajectory
        fn = by_source.get(ctx.sample.data_source)
        if fn is not None:
            value = fn(ctx)
            traj.metrics[REWARD_SOURCE] = "reward_fn"
            return float(await value) if inspect.isawaitable(value) else float(value)
        score = await ctx.env.score(traj) if ctx.env is not None else None
        if score is not None:
            traj.metrics[REWARD_SOURCE] = "env_score"
            return float(score)
        if any(r != 0.0 for r in traj.turn_rewards):
            traj.metrics[REWARD_SOURCE] = "step_rewards"
        return float(sum(traj.turn_rewards))

    return reward


def computed_reward(traj: Trajectory) -> float | None:
    """The trajectory's reward when turnrl computed one (see ``tracked_reward``), else None."""
    if REWARD_SOURCE not in traj.metrics or traj.reward is None or not math.isfinite(traj.reward):
        return None
    return float(traj.reward)
