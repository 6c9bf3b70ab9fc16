"""Find the sample a trainer's prompt came from, when the trainer hands over prompts only.

Prompts built by ``tag_prompt`` carry the sample id in their first message (an extra
``turnrl_id`` field that chat templates ignore), so they map back exactly, even when several
samples share one prompt text (the same question with different hidden answers). Untagged
prompts map back by their text, as long as that text is not shared by samples that differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from turnrl.types import Message, Sample

ID_FIELD = "turnrl_id"

Prompt = str | Sequence[Mapping[str, Any]]


def _strip(value: Any) -> Any:
    """Drop the id field and None-valued keys at every depth (columnar datasets fill absent keys)."""
    if isinstance(value, Mapping):
        return {str(k): _strip(v) for k, v in value.items() if v is not None and k != ID_FIELD}
    if isinstance(value, list | tuple):
        return [_strip(v) for v in value]
    return value


def prompt_key(prompt: Prompt) -> str:
    """A canonical text for a prompt: a string is one user message; key order, None fields and the id
    field do not count."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return json.dumps(_strip(messages), sort_keys=True, ensure_ascii=False, default=str)


def tag_prompt(sample: Sample) -> list[Message]:
    """The sample's prompt messages with its id in the first message."""
    messages: list[dict[str, Any]] = [dict(m) for m in sample.prompt]
    if messages:
        messages[0][ID_FIELD] = sample.id
    return cast(list[Message], messages)


def tagged_id(prompt: Prompt) -> str | None:
    """The sample id a ``tag_prompt`` prompt carries, else None."""
    if isinstance(prompt, str) or not prompt:
        return None
    value = prompt[0].get(ID_FIELD)
    return None if value is None else str(value)


def _same_task(a: Sample, b: Sample) -> bool:
    """Two samples the env cannot tell apart (ids aside)."""
    return (a.prompt, a.data_source, a.tools, a.tools_kwargs, a.metadata) == (
        b.prompt,
        b.data_source,
        b.tools,
        b.tools_kwargs,
        b.metadata,
    )


class PromptIndex:
    """Samples by id (tagged prompts) and by prompt text (untagged ones)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Sample] = {}
        self._by_key: dict[str, Sample] = {}
        self._ambiguous: dict[str, tuple[str, str]] = {}  # prompt key -> two samples that differ

    def add(self, sample: Sample, prompt: Prompt | None = None) -> None:
        """Index ``sample`` by its id and by ``prompt`` (default: its own prompt)."""
        self._by_id[sample.id] = sample
        key = prompt_key(sample.prompt if prompt is None else prompt)
        known = self._by_key.setdefault(key, sample)
        if known is not sample and not _same_task(known, sample):
            self._ambiguous.setdefault(key, (known.id, sample.id))

    def lookup(self, prompt: Prompt) -> Sample:
        """The sample of ``prompt``; LookupError when it is unknown or its text is ambiguous."""
        sample_id = tagged_id(prompt)
        if sample_id is not None:
            if sample_id not in self._by_id:
                raise LookupError(f"prompt tagged with unknown sample id {sample_id!r}")
            return self._by_id[sample_id]
        key = prompt_key(prompt)
        if key in self._ambiguous:
            a, b = self._ambiguous[key]
            raise LookupError(
                f"samples {a!r} and {b!r} share this prompt but differ (metadata, tools or data source); "
                f"use prompts that carry the sample id (rollout.dataset()): {key[:200]}"
            )
        if key not in self._by_key:
            raise LookupError(
                f"prompt not among the rollout's samples: {key[:200]}; build the trainer's dataset from "
                "the same samples (rollout.dataset())"
            )
        return self._by_key[key]

    def __len__(self) -> int:
        return len(self._by_id)
