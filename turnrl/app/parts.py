"""Configs into the parts of a rollout: samples, env factories, reward routing, the rollout spec."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from turnrl.chat.encoder import ChatEncoder
from turnrl.config import ChatConfig, DataConfig, EnvConfig, RunSections
from turnrl.data import read_rows, to_samples
from turnrl.env.base import Env, EnvFactory
from turnrl.env.registry import EnvEntry, resolve_env
from turnrl.env.rewards import Rewards
from turnrl.models import load_vision_processor, vocab_size
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.errors import describe
from turnrl.support.imports import import_object
from turnrl.tools.parser_base import ToolParser
from turnrl.types import Engine, Sample


class RunError(ValueError):
    """A run that cannot start; the message says why."""


def load_samples(data: DataConfig, entry: EnvEntry | None) -> list[Sample]:
    """Samples from a file, a generator, or the env's own data (``entry``; None for an agent
    harness). Rows need a ``prompt`` unless the env is a class whose ``reset()`` builds one (or a
    factory turnrl cannot see into; its reset is checked when it runs)."""
    required = entry is None or builds_no_prompt(entry.factory)
    if data.path:
        return to_samples(read_rows(data.path, data.split), data.path, data.limit, required)
    if data.generator:
        generator = import_object(data.generator, "data generator")
        return to_samples(_generated(generator, data), data.generator, data.limit, required)
    if entry is None or entry.dataset is None:
        raise RunError("no data: set data.path or data.generator (this env has no data of its own)")
    return to_samples(entry.dataset(**data.kwargs), "the env's data", data.limit, required)


def builds_no_prompt(factory: Any) -> bool:
    """Whether an env class starts from the row's prompt (it keeps ``Env.reset``)."""
    return isinstance(factory, type) and issubclass(factory, Env) and factory.reset is Env.reset


def _generated(generator: Any, data: DataConfig) -> Iterator[dict[str, Any]]:
    """The generator's rows; its error, when it is called or while it yields, as one line."""
    try:
        yield from generator(**data.kwargs)
    except Exception as exc:
        raise RunError(f"data.generator {data.generator} failed: {describe(exc)}") from None


def build_env_factory(env: EnvConfig, entry: EnvEntry | None = None) -> EnvFactory:
    """The env factory: in-process (routed by each row's ``env``), or each env built and run in a
    Ray worker actor."""
    entry = entry or resolve_env(env.name)
    factory = entry.bind(env.kwargs)  # checks the kwargs here, before any worker starts
    if not env.ray.enabled:
        return EnvRouter(factory, {key: resolve_env(r.name).bind(r.kwargs) for key, r in env.routes.items()})
    if env.routes:
        raise RunError("env.routes runs envs in this process: set env.ray.enabled false")
    try:
        from turnrl.distributed import ray_env_factory
    except ImportError as exc:
        raise RunError(f"env.ray.enabled needs ray: pip install 'turnrl[ray]' ({exc})") from None
    return ray_env_factory(entry.factory, env.kwargs, env.ray)


class EnvRouter:
    """Builds each row's env: the run's own, a route of ``env.routes``, or an env the row names
    (resolved once, then kept)."""

    def __init__(self, default: EnvFactory, routes: dict[str, EnvFactory]) -> None:
        self.default = default
        self.routes = dict(routes)

    def __call__(self, sample: Sample) -> Env:
        if sample.env is None:
            return self.default(sample)
        factory = self.routes.get(sample.env)
        if factory is None:  # a row naming an env itself: unknown names fail this trajectory only
            factory = self.routes[sample.env] = resolve_env(sample.env).bind({})
        return factory(sample)


def build_rewards(config: RunSections) -> Rewards:
    """The reward routing of ``rewards`` and ``group_rewards`` ("module:function" per data source)
    and ``judges`` (an LLM judge per data source, built here: its engine starts now)."""
    rewards = Rewards(
        by_source={src: import_object(fn, f"reward for {src!r}") for src, fn in config.rewards.items()},
        groups={
            src: import_object(fn, f"group reward for {src!r}") for src, fn in config.group_rewards.items()
        },
    )
    for src, judge_config in config.judges.items():
        taken = rewards.groups if judge_config.mode == "rank" else rewards.by_source
        if src in taken:
            raise RunError(f"data source {src!r} has both a judge and a reward function of the same kind")
        from turnrl.app.judge import Judge

        judge = Judge(judge_config)
        if judge_config.mode == "rank":
            rewards.groups[src] = judge.rank
        else:
            rewards.by_source[src] = judge.score
    return rewards


def build_encoder(model: str, chat: ChatConfig, tokenizer: Any) -> ChatEncoder:
    """The chat encoder of ``model`` (its template's options, its image processor where it has one)."""
    return ChatEncoder(tokenizer, chat.template_kwargs, load_vision_processor(model, tokenizer))


def template_parser(tokenizer: Any, name: str | None = None) -> ToolParser | None:
    """The tool-call parser ``name``, else the one the model's chat template names (None: none)."""
    from turnrl.tools.parsers import get_parser, parser_for_template

    name = name or parser_for_template(str(getattr(tokenizer, "chat_template", None) or ""))
    return get_parser(name) if name else None


def build_spec(
    config: RunSections, engine: Engine, tokenizer: Any, env_factory: EnvFactory | None
) -> RolloutSpec:
    """The rollout spec of a run: its engine, env (None: a harness, ``app.kinds``), chat encoder,
    sampling (seeded), limits, rewards."""
    encoder = build_encoder(config.model, config.chat, tokenizer)
    return RolloutSpec(
        env_factory=env_factory,
        engine=engine,
        encoder=encoder,
        sampling=dataclasses.replace(config.sampling, seed=config.seed),
        limits=config.limits,
        check=config.chat.check,
        inference_contexts=config.chat.inference_contexts,
        rewards=build_rewards(config),
        vocab_size=vocab_size(config.model),
    )
