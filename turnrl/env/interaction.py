"""Simulated users: verl's interaction lifecycle, loaded from verl's interaction YAML.

An interaction answers a model turn that ends without a tool call, as the user would::

    start_interaction(instance_id, **interaction_kwargs) -> instance_id
    generate_response(instance_id, messages, **interaction_kwargs) -> (terminate, text, turn_score, meta)
    calculate_score(instance_id, **interaction_kwargs) -> float
    finalize_interaction(instance_id, **interaction_kwargs)

The YAML (seed 001's ``interaction:`` format) lists them; a data row chooses one by name in its
``interaction_kwargs`` (or verl's ``extra_info.interaction_kwargs``)::

    interaction:
      - name: tutor
        class_name: my_module.TutorInteraction   # or turnrl.app.LLMUser: a second model
        config: {}

Any class with these methods works, verl's own ``BaseInteraction`` subclasses included; their
``calculate_score`` / ``finalize_interaction`` may also take no instance id (verl's base class).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from turnrl.support.errors import describe
from turnrl.support.imports import ImportSpecError, import_object
from turnrl.tools.files import file_version, read_data_file
from turnrl.types import Sample


class InteractionError(ValueError):
    """An interaction config or a row's choice of interaction that cannot work; one line says why."""


class Interaction(Protocol):
    """What the env calls (verl's ``BaseInteraction``)."""

    name: str

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str: ...

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]: ...


def load_interactions(source: str | Path | Mapping[str, Any]) -> dict[str, Interaction]:
    """The interactions of a YAML file (or its loaded mapping), by name."""
    data = read_data_file(source, "interaction config", InteractionError)
    entries = data.get("interaction") if isinstance(data, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise InteractionError("interaction config needs an 'interaction' list")
    out: dict[str, Interaction] = {}
    for index, entry in enumerate(entries):
        interaction = _build(entry, index)
        if interaction.name in out:
            raise InteractionError(f"two interactions are named {interaction.name!r}")
        out[interaction.name] = interaction
    return out


@functools.lru_cache(maxsize=16)
def cached_interactions(path: str, mtime_ns: int) -> dict[str, Interaction]:
    """The interactions of one file version, built once per process (they are shared, like tools)."""
    return load_interactions(path)


def interactions_from_file(path: str | Path) -> dict[str, Interaction]:
    """``load_interactions`` of a file, cached per file version."""
    return cached_interactions(*file_version(path))


def _build(entry: Any, index: int) -> Interaction:
    if not isinstance(entry, Mapping) or not entry.get("class_name"):
        raise InteractionError(f"interaction[{index}] needs a 'class_name'")
    class_name = str(entry["class_name"])
    config = dict(entry.get("config") or {})
    if entry.get("name"):
        config["name"] = str(entry["name"])
    try:
        cls = import_object(class_name, f"interaction[{index}] class")
    except ImportSpecError as exc:
        raise InteractionError(str(exc)) from None
    try:
        interaction = cls(config)
    except Exception as exc:
        why = describe(exc)
        raise InteractionError(f"interaction[{index}] ({class_name}) cannot be built: {why}") from None
    missing = [
        m for m in ("start_interaction", "generate_response") if not callable(getattr(interaction, m, None))
    ]
    if missing:
        raise InteractionError(f"interaction[{index}] ({class_name}) has no {', '.join(missing)}")
    if not getattr(interaction, "name", None):
        interaction.name = str(config.get("name") or cls.__name__)
    return interaction


def interaction_kwargs(sample: Sample) -> dict[str, Any]:
    """A row's ``interaction_kwargs`` (top level or verl's ``extra_info``)."""
    kwargs = sample.metadata.get("interaction_kwargs")
    if kwargs is None:
        extra = sample.metadata.get("extra_info")
        kwargs = extra.get("interaction_kwargs") if isinstance(extra, Mapping) else None
    return dict(kwargs or {})


def choose(interactions: Mapping[str, Interaction], sample: Sample) -> tuple[Interaction, dict[str, Any]]:
    """The interaction a row names (the only one when there is one and the row names none)."""
    kwargs = interaction_kwargs(sample)
    name = kwargs.get("name")
    if name is None and len(interactions) == 1:
        return next(iter(interactions.values())), kwargs
    if name not in interactions:
        known = ", ".join(interactions) or "none"
        raise InteractionError(f"sample '{sample.id}' names interaction {name!r}; known: {known}")
    return interactions[str(name)], kwargs


async def call_optional(interaction: Any, method: str, instance_id: str, kwargs: dict[str, Any]) -> Any:
    """Call ``calculate_score`` / ``finalize_interaction`` with the instance id and kwargs when the
    method takes them (verl's base class declares neither)."""
    fn = getattr(interaction, method, None)
    if fn is None:
        return None
    params = inspect.signature(fn).parameters
    takes_args = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()) or len(params) > 0
    return await (fn(instance_id, **kwargs) if takes_args else fn())
