"""A config's fields as a user reads them: dotted key, type, default and doc, section by section."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class FieldDoc:
    """One config key."""

    key: str  # dotted, e.g. engine.max_batch_size
    type: str  # as written in the code, e.g. int | None
    default: str  # the default as YAML would show it; "required" when there is none
    doc: str  # the field's one-line doc


def _fields(cls: Any) -> dict[str, FieldInfo]:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return dict(cls.model_fields)
    return dict(getattr(cls, "__pydantic_fields__", {}))


def _is_section(cls: Any) -> bool:
    return isinstance(cls, type) and bool(_fields(cls))


def _sections(annotation: Any) -> list[Any]:
    """The config sections an annotation holds (one, or each member of a union)."""
    if _is_section(annotation):
        return [annotation]
    if typing.get_origin(annotation) is typing.Annotated:
        return _sections(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [s for arg in typing.get_args(annotation) for s in _sections(arg)]
    return []


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        return "{...}" if _is_section(type(value)) else repr(value)
    if info.default is PydanticUndefined:
        return "required"
    return repr(info.default)


def field_docs(cls: Any, prefix: str = "") -> Iterator[FieldDoc]:
    """Every key of config class ``cls``, sections first-level then nested, in declaration order.
    A union of sections (the engine) lists each kind's keys, tagged with the kind."""
    for name, info in _fields(cls).items():
        key = f"{prefix}{name}"
        sections = _sections(info.annotation)
        kinds = [_kind(section) for section in sections]
        type_name = (
            " | ".join(f"{k} section" for k in kinds) if len(sections) > 1 else _type_name(info.annotation)
        )
        yield FieldDoc(key, type_name, _default(info), info.description or "")
        for section, kind in zip(sections, kinds, strict=True):
            tag = f" (when kind is {kind})" if len(sections) > 1 else ""
            for doc in field_docs(section, f"{key}."):
                yield FieldDoc(doc.key, doc.type, doc.default, doc.doc + tag)


def _kind(section: Any) -> str:
    """The ``kind`` a section of a union is picked by (its Literal's value)."""
    info = _fields(section).get("kind")
    args = typing.get_args(info.annotation) if info is not None else ()
    return str(args[0]) if args else section.__name__


def render(docs: Iterator[FieldDoc]) -> str:
    """The docs as aligned text lines: ``key  type = default  doc``."""
    rows = [(d.key, f"{d.type} = {d.default}", d.doc) for d in docs]
    width = [max((len(r[i]) for r in rows), default=0) for i in range(2)]
    return "\n".join(f"{k:<{width[0]}}  {t:<{width[1]}}  {doc}".rstrip() for k, t, doc in rows)
