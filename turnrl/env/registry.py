"""Envs by name: built-in ones, user-registered ones, or any ``module:Class``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnrl.env.base import Env, EnvFactory
from turnrl.support.imports import import_object
from turnrl.types import Sample

Rows = list[dict[str, Any]]


@dataclass
class EnvEntry:
    """A registered env: how to build it, and (optionally) its own data."""

    factory: Callable[..., Env]  # called as factory(sample, **kwargs)
    dataset: Callable[..., Rows] | None = None  # default data rows, called with data.kwargs

    def bind(self, kwargs: dict[str, Any]) -> EnvFactory:
        """A one-argument factory with the config's kwargs applied (checked against its signature)."""
        factory = self.factory
        try:
            inspect.signature(factory).bind(None, **kwargs)
        except TypeError as exc:
            raise ValueError(
                f"env kwargs do not fit {getattr(factory, '__name__', factory)}: {exc}"
            ) from None
        except ValueError:  # no signature to check (a builtin or C callable)
            pass

        def build(sample: Sample) -> Env:
            return factory(sample, **kwargs)

        return build


_ENVS: dict[str, EnvEntry] = {}
_BUILTIN = {
    "tool_env": "turnrl.env.builtin.tool_config:ConfiguredToolEnv",
    "math_tools": "turnrl.env.builtin.math_tools:MathToolEnv",
    "guess_number": "turnrl.env.builtin.guess_number:GuessNumberEnv",
    "textarena": "turnrl.env.adapters.textarena_env:TextArenaEnv",
    "swift_scheduler": "turnrl.env.builtin.swift_scheduler:ThinkingTipsEnv",
    "frozen_lake": "turnrl.env.builtin.frozen_lake:FrozenLakeEnv",
    "zoom": "turnrl.env.builtin.zoom:ZoomEnv",
    "search_qa": "turnrl.env.builtin.search_qa:SearchQAEnv",
    "gymnasium": "turnrl.env.adapters.gym_env:GymnasiumEnv",
    "skyrl_gym": "turnrl.env.adapters.skyrl_gym_env:SkyRLGymEnv",
    "openenv": "turnrl.env.adapters.openenv_env:OpenEnvEnv",
}


def register_env(name: str, factory: Callable[..., Env], dataset: Callable[..., Rows] | None = None) -> None:
    """Make ``name`` usable as ``env.name`` in configs."""
    _ENVS[name] = EnvEntry(factory, dataset)


def resolve_env(name: str) -> EnvEntry:
    """The env registered as ``name``, a built-in, or ``module:Class``."""
    if name in _ENVS:
        return _ENVS[name]
    spec = _BUILTIN.get(name, name)
    if ":" not in spec and "." not in spec:
        known = ", ".join(sorted({*_ENVS, *_BUILTIN}))
        raise ValueError(f"unknown env {name!r} (known: {known}; or give module:Class)")
    factory = import_object(spec, "env")
    dataset = getattr(factory, "dataset", None)
    return EnvEntry(factory, dataset if callable(dataset) else None)
