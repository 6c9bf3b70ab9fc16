"""Tools from plain typed functions: the schema comes from the signature and the Google-style docstring."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import re
import threading
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints, overload

from turnrl.tools.base import BaseTool, ToolArgumentError, ToolOutput, ToolSchema, as_tool_output

_NoneType = type(None)
_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_ARRAYS = (list, tuple, set, frozenset, Sequence, Iterable)
_OBJECTS = (dict, Mapping)
_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Returns?|Yields?|Raises|Examples?|Notes?|"
    r"Attributes|See Also|Warnings?|Todo|References)\s*:\s*$"
)
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


@dataclass
class Docstring:
    """The parts of a Google-style docstring a tool schema uses."""

    summary: str  # the first paragraph, joined into one line
    args: dict[str, str] = field(default_factory=dict)  # parameter name -> description


def parse_docstring(doc: str | None) -> Docstring:
    """Parse the summary paragraph and the ``Args:`` section of a Google-style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        summary.append(line.strip())
    return Docstring(" ".join(summary), _parse_args_section(lines))


def _parse_args_section(lines: list[str]) -> dict[str, str]:
    start = next((i + 1 for i, line in enumerate(lines) if _is_args_header(line)), None)
    if start is None:
        return {}
    args: dict[str, str] = {}
    item_indent: int | None = None
    current: str | None = None
    for line in lines[start:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break  # the next section
        item_indent = indent if item_indent is None else item_indent
        match = _ARG_LINE.match(line.strip())
        if indent <= item_indent and match:
            current = match.group(1)
            args[current] = match.group(2).strip()
        elif current is not None:
            args[current] = f"{args[current]} {line.strip()}".strip()
    return args


def _is_args_header(line: str) -> bool:
    match = _SECTION.match(line.strip())
    return bool(match) and line.strip().rstrip(":").strip() in ("Args", "Arguments", "Parameters", "Params")


def type_schema(tp: Any) -> dict[str, Any]:
    """The JSON schema of a Python type annotation (str, int, float, bool, list[X], dict, Literal,
    Optional, unions). ``Any`` or no annotation gives ``{}``."""
    if tp is Any or tp is inspect.Parameter.empty:
        return {}
    if tp is _NoneType or tp is None:
        return {"type": "null"}
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return type_schema(args[0])
    if origin is Literal:
        return _literal_schema(list(args))
    if origin is Union or origin is types.UnionType:
        return _union_schema(list(args))
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp in _ARRAYS or origin in _ARRAYS:
        items = [a for a in args if a is not Ellipsis]
        return {"type": "array", "items": type_schema(items[0])} if items else {"type": "array"}
    if tp in _OBJECTS or origin in _OBJECTS:
        if len(args) == 2 and args[1] is not Any:
            return {"type": "object", "additionalProperties": type_schema(args[1])}
        return {"type": "object"}
    raise TypeError(f"unsupported type annotation {tp!r}")


def _literal_schema(values: list[Any]) -> dict[str, Any]:
    kinds = {_SCALARS.get(type(v)) for v in values}
    kind = kinds.pop() if len(kinds) == 1 else None
    return {"type": kind, "enum": values} if kind else {"enum": values}


def _union_schema(members: list[Any]) -> dict[str, Any]:
    non_null = [m for m in members if m is not _NoneType]
    single = len(non_null) == 1
    schema: dict[str, Any] = (
        type_schema(non_null[0]) if single else {"anyOf": [type_schema(m) for m in non_null]}
    )
    if len(non_null) < len(members):
        schema["nullable"] = True
    return schema


def function_schema(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    exclude: Iterable[str] = (),
) -> ToolSchema:
    """Derive the OpenAI function schema of a typed function from its signature and docstring.

    The description is the docstring's first paragraph; ``Args:`` gives the parameter descriptions;
    parameters without a default are required. ``exclude`` names parameters the model does not fill.
    """
    doc = parse_docstring(inspect.getdoc(fn))
    hints = _type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in _model_params(fn, set(exclude)):
        try:
            prop = type_schema(hints.get(param.name, param.annotation))
        except TypeError as e:
            raise TypeError(f"{_fn_name(fn)}: parameter '{param.name}': {e}") from None
        if doc.args.get(param.name):
            prop["description"] = doc.args[param.name]
        properties[param.name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    function = {
        "name": name or _fn_name(fn),
        "description": description or doc.summary,
        "parameters": parameters,
    }
    return {"type": "function", "function": function}


def _model_params(fn: Callable[..., Any], exclude: set[str]) -> list[inspect.Parameter]:
    params = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name in exclude:
            continue
        if param.kind is param.POSITIONAL_ONLY:
            raise TypeError(f"{_fn_name(fn)}: positional-only parameter '{param.name}' is not supported")
        params.append(param)
    return params


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return get_type_hints(fn, include_extras=True)
    except Exception:  # unresolvable forward references, callables without annotations
        return {p.name: p.annotation for p in inspect.signature(fn).parameters.values()}


def _fn_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None)
    if not name or name == "<lambda>":
        raise ValueError(f"cannot name tool {fn!r}: pass name=...")
    return str(name)


def matches_type(value: Any, tp: Any) -> bool:
    """True when a JSON-decoded ``value`` fits the annotation ``tp`` (unknown annotations accept anything)."""
    if tp is Any or tp is inspect.Parameter.empty:
        return True
    if tp is _NoneType or tp is None:
        return value is None
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return matches_type(value, args[0])
    if origin is Literal:
        return value in args
    if origin is Union or origin is types.UnionType:
        return any(matches_type(value, a) for a in args)
    if tp in _SCALARS:
        return _matches_scalar(value, tp)
    if tp in _ARRAYS or origin in _ARRAYS:
        if not isinstance(value, list):
            return False
        items = [a for a in args if a is not Ellipsis]
        return len(items) != 1 or all(matches_type(v, items[0]) for v in value)
    if tp in _OBJECTS or origin in _OBJECTS:
        return isinstance(value, dict) and (
            len(args) != 2 or all(matches_type(v, args[1]) for v in value.values())
        )
    return True


def _matches_scalar(value: Any, tp: type) -> bool:
    if isinstance(value, bool):
        return tp is bool
    if tp is float:
        return isinstance(value, int | float)
    return isinstance(value, tp)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


class FunctionTool(BaseTool):
    """A stateless tool that calls a typed Python function, sync (run in a thread) or async.

    Arguments from the model are checked against the signature before the call; a number or boolean
    given where only text fits becomes its JSON text (XML-style parsers decode values without the
    schema). ``injected`` names parameters filled from the env's execute kwargs
    (``sample.tools_kwargs[name]["execute_kwargs"]``) rather than by the model; they are left out of
    the schema. A function with ``**kwargs`` receives every execute kwarg.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        tool_schema: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        injected: Iterable[str] = (),
    ) -> None:
        self.fn = fn
        self.injected = frozenset(injected)
        self._hints = _type_hints(fn)
        self._params = {p.name: p for p in _model_params(fn, set(self.injected))}
        self._takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
        self._check_injected()
        schema = tool_schema or function_schema(fn, name=name, description=description, exclude=self.injected)
        super().__init__(config=config, tool_schema=schema)
        if name and tool_schema:
            self.schema["function"]["name"] = name

    def _check_injected(self) -> None:
        names = set(inspect.signature(self.fn).parameters)
        unknown = sorted(self.injected - names)
        if unknown and not self._takes_kwargs:
            raise ValueError(f"{_fn_name(self.fn)} has no parameter(s) {_quoted(unknown)} to inject")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolOutput:
        """Check the arguments, call the function and normalize its result."""
        call_kwargs = {**self.check_arguments(parameters), **self._injected_kwargs(kwargs)}
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**call_kwargs)
        else:
            result = await in_daemon_thread(self.fn, call_kwargs)
            if inspect.isawaitable(result):
                result = await result
        return as_tool_output(result)

    def check_arguments(self, arguments: Any) -> dict[str, Any]:
        """Return ``arguments`` when they fit the signature; raise ToolArgumentError otherwise."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(
                f"arguments of tool '{self.name}' must be an object, got {_json_type(arguments)}"
            )
        unknown = [k for k in arguments if k not in self._params]
        if unknown:
            expected = ", ".join(self._params) or "no arguments"
            raise ToolArgumentError(
                f"tool '{self.name}' got unknown argument(s) {_quoted(unknown)}; it takes: {expected}"
            )
        missing = [n for n, p in self._params.items() if p.default is p.empty and n not in arguments]
        if missing:
            raise ToolArgumentError(f"tool '{self.name}' is missing required argument(s) {_quoted(missing)}")
        return {key: self._checked(key, value) for key, value in arguments.items()}

    def _checked(self, key: str, value: Any) -> Any:
        tp = self._hints.get(key, self._params[key].annotation)
        if matches_type(value, tp):
            return value
        if isinstance(value, int | float) and matches_type(json.dumps(value), tp):
            return json.dumps(value)  # XML-style parsers decode "42" to 42 without knowing the schema
        expected = type_schema(tp).get("type") or getattr(tp, "__name__", None) or repr(tp)
        got = f"{_json_type(value)} {value!r}"
        raise ToolArgumentError(f"argument '{key}' of tool '{self.name}' must be {expected}, got {got[:120]}")

    def _injected_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in kwargs.items() if self._takes_kwargs or k in self.injected}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function directly."""
        return self.fn(*args, **kwargs)


async def in_daemon_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``fn(**kwargs)`` in a thread of its own that never holds up the process: a tool that blocks
    past its timeout is left behind (its result dropped) instead of keeping ``asyncio.run``, and the
    interpreter, waiting at exit as the default executor's threads do."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, error = context.run(fn, **kwargs), None
        except BaseException as exc:  # handed to the caller, whatever it is
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name=f"tool {_fn_name(fn)}", daemon=True).start()
    return await future


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)


@overload
def tool(fn: Callable[..., Any], /) -> FunctionTool: ...


@overload
def tool(
    *, name: str | None = None, description: str | None = None, injected: Iterable[str] = ()
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    injected: Iterable[str] = (),
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Turn a typed function into a FunctionTool; use as ``@tool`` or ``@tool(name=...)``."""
    if fn is not None:
        return FunctionTool(fn, name=name, description=description, injected=injected)

    def wrap(f: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(f, name=name, description=description, injected=injected)

    return wrap
