"""Typed run configuration, loaded from YAML with dotted ``--set key=value`` overrides."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from turnrl.distributed.config import RayEngineConfig, RayEnvConfig
from turnrl.engines.base import SamplingParams
from turnrl.rollout.loop import Limits


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineConfig(_Strict):
    """Which engine generates, and how."""

    kind: Literal["hf", "openai", "sglang", "vllm"] = "hf"  # hf: embedded transformers engine
    max_batch_size: int = Field(32, ge=1)  # hf: sequences decoded together
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # hf
    device: str = "cpu"  # hf
    urls: list[str] = Field(default_factory=list)  # openai/sglang servers; several: load-balanced
    dialect: Literal["vllm", "sglang", "llamacpp"] = "vllm"  # openai: which server speaks
    served_model: str | None = None  # openai: the server's "model" field
    api_key_env: str | None = None  # name of the environment variable holding the API key
    timeout_s: float = Field(300.0, gt=0)  # one request
    max_retries: int = Field(3, ge=0)  # connection errors, 5xx, timeouts
    retry_budget_s: float = Field(600.0, gt=0)  # total seconds of retrying for one request
    max_sticky_turns: int = Field(32, ge=1)  # balancer: turns a trajectory stays on one server
    load_factor: float = Field(2.0, ge=1)  # balancer: move off a server this much busier than the least
    cooloff_s: float = Field(30.0, ge=0)  # balancer: how long a failed server is left out
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict)  # vllm: AsyncEngineArgs
    ray: RayEngineConfig = Field(default_factory=RayEngineConfig)  # engine actors / registry; off: local


class ChatConfig(_Strict):
    """Chat template options."""

    template_kwargs: dict[str, Any] = Field(default_factory=dict)  # e.g. {enable_thinking: false}
    check: Literal["strict", "ignore_strippable", "disable"] = "strict"  # end-of-trajectory check


class EnvConfig(_Strict):
    """The environment: a registered name or ``module:Class``, and its constructor kwargs."""

    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    ray: RayEnvConfig = Field(default_factory=RayEnvConfig)  # env workers on Ray; off: in-process


class DataConfig(_Strict):
    """Where samples come from: a JSONL/JSON file, or a generator (registered env data or module:fn)."""

    path: str | None = None  # JSONL or JSON list of rows with at least a "prompt"
    generator: str | None = None  # "module:function" returning rows; default: the env's own data
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to the generator
    limit: int | None = Field(None, ge=1)  # use the first N samples


class SamplingConfig(_Strict):
    """Per-turn sampling."""

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(256, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)  # extra stop tokens, on top of the eos ids

    def params(self, seed: int | None = None) -> SamplingParams:
        """The engine's sampling params."""
        stops = tuple(self.stop_token_ids)
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.max_tokens, stops, seed)


class LimitsConfig(_Strict):
    """When trajectories stop."""

    max_turns: int = Field(8, ge=1)
    max_context_tokens: int = Field(4096, ge=16)
    max_response_tokens: int | None = Field(None, ge=1)
    max_env_retries_per_turn: int = Field(2, ge=0)
    env_timeout_s: float | None = Field(60.0, gt=0)

    def limits(self) -> Limits:
        """The loop's limits."""
        return Limits(**self.model_dump())


class RolloutConfig(_Strict):
    """How many trajectories, and how many at once."""

    n: int = Field(1, ge=1)  # trajectories per prompt (a GRPO group)
    concurrency: int = Field(32, ge=1)  # trajectories in flight
    seed: int = 0
    log_turns: bool = False  # also write every turn to turns.jsonl as it happens


class RunConfig(_Strict):
    """A whole ``turnrl rollout`` run."""

    model: str  # HF id, local folder, or a shipped name: tiny-qwen3, smollm2-135m
    env: EnvConfig
    data: DataConfig = Field(default_factory=DataConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    chat: ChatConfig = Field(default_factory=ChatConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: dict[str, str] = Field(default_factory=dict)  # data_source -> "module:function"
    output_dir: str = "runs/rollout"


def _parse_value(raw: str) -> Any:
    """A --set value: YAML scalars and lists (``3``, ``true``, ``[a, b]``), else the string."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return data


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "config"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    if err["type"] == "extra_forbidden":
        return f"unknown config key {where!r}{more}"
    if err["type"] == "missing":
        return f"missing config key {where!r}{more}"
    return f"config key {where!r}: {err['msg']}{more}"


M = TypeVar("M", bound=BaseModel)


def read_yaml_mapping(path: str | os.PathLike[str], error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """A YAML file's top-level mapping; ``error`` with a one-line reason when it has none."""
    file = Path(path)
    if not file.is_file():
        raise error(f"config file not found: {file}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise error(f"config file {file} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"config file {file} must hold a mapping at the top")
    return data


def load_model_config(path: str | Path, model: type[M], overrides: list[str] | None = None) -> M:
    """Read a YAML config, apply ``--set`` overrides, validate it as ``model``."""
    data = apply_overrides(read_yaml_mapping(path), overrides or [])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_first_error(exc)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a rollout config, apply overrides, validate."""
    return load_model_config(path, RunConfig, overrides)
