"""Tools: schemas from typed functions, FunctionTool, as_tool_output, the calculator, YAML config loading."""

from __future__ import annotations

import asyncio
import gc
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Literal

import pytest

from turnrl.tools import (
    BaseTool,
    FunctionTool,
    ToolArgumentError,
    ToolConfigError,
    ToolOutput,
    as_tool_output,
    calculator,
    function_schema,
    load_tools_config,
    tool,
)


def search(
    query: str,
    top_k: int = 3,
    mode: Literal["web", "news"] = "web",
    tags: list[str] | None = None,
    weights: dict[str, float] | None = None,
    exact: bool = False,
    threshold: float = 0.5,
) -> list[str]:
    """Search the web for pages.

    Returns the titles of the best pages.

    Args:
        query: What to look for.
        top_k (int): How many results to return,
            at most 10.
        mode: Which index to search.
        tags: Only pages with these tags.
        weights: Score weight per field.
        exact: Match the query exactly.
        threshold: Minimum score.

    Returns:
        The page titles.
    """
    return [query] * top_k


def test_function_schema_from_signature_and_docstring() -> None:
    schema = function_schema(search)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "search"
    assert function["description"] == "Search the web for pages."
    params = function["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["query"]
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "What to look for."}
    assert props["top_k"] == {"type": "integer", "description": "How many results to return, at most 10."}
    assert props["mode"] == {
        "type": "string",
        "enum": ["web", "news"],
        "description": "Which index to search.",
    }
    assert props["tags"] == {
        "type": "array",
        "items": {"type": "string"},
        "nullable": True,
        "description": "Only pages with these tags.",
    }
    assert props["weights"]["type"] == "object"
    assert props["weights"]["additionalProperties"] == {"type": "number"}
    assert props["exact"]["type"] == "boolean"
    assert props["threshold"]["type"] == "number"


def test_function_schema_without_docstring_and_overrides() -> None:
    def add(a: int, b: int = 1, *args: Any, **kwargs: Any) -> int:
        return a + b

    schema = function_schema(add, name="plus", description="Add two numbers.")
    assert schema["function"]["name"] == "plus"
    assert schema["function"]["description"] == "Add two numbers."
    assert list(schema["function"]["parameters"]["properties"]) == ["a", "b"]
    assert schema["function"]["parameters"]["required"] == ["a"]


def test_function_schema_rejects_unsupported_types() -> None:
    def f(x: complex) -> None: ...

    with pytest.raises(TypeError, match="parameter 'x'"):
        function_schema(f)


@tool
def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: The first one.
        b: The second one.
    """
    return a + b


async def test_tool_decorator_and_sync_function_runs_in_a_thread() -> None:
    thread_ids: list[int] = []

    @tool(name="where")
    def where_am_i() -> str:
        """Report the thread."""
        thread_ids.append(threading.get_ident())
        return "here"

    assert isinstance(add, FunctionTool)
    assert add.name == "add"
    assert add(2, 3) == 5  # still callable directly
    assert await add.execute("i", {"a": 2, "b": 0.5}) == ToolOutput("2.5")
    assert where_am_i.name == "where"
    assert (await where_am_i.execute("i", {})).text == "here"
    assert thread_ids and thread_ids[0] != threading.get_ident()


async def test_async_function_tool() -> None:
    @tool
    async def echo(text: str) -> ToolOutput:
        """Echo the text."""
        await asyncio.sleep(0)
        return ToolOutput(text, reward=1.0, metrics={"n": 1})

    assert await echo.execute("i", {"text": "hi"}) == ToolOutput("hi", 1.0, {"n": 1})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "tool 'add' is missing required argument(s) 'a'"),
        ({"a": 1, "c": 2}, "tool 'add' got unknown argument(s) 'c'; it takes: a, b"),
        ({"a": "one"}, "argument 'a' of tool 'add' must be integer, got string 'one'"),
        ({"a": True}, "argument 'a' of tool 'add' must be integer"),
        ({"a": 1, "b": [1]}, "argument 'b' of tool 'add' must be number"),
    ],
)
async def test_function_tool_argument_errors(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ToolArgumentError) as excinfo:
        await add.execute("i", arguments)
    assert message in str(excinfo.value)


async def test_number_for_a_str_parameter_becomes_its_text() -> None:
    @tool
    def shout(text: str) -> str:
        """Shout."""
        return text + "!"

    @tool
    def pick(choice: Literal["1", "2"], note: str | None = None) -> str:
        """Pick one."""
        return f"{choice} {note}"

    assert (await shout.execute("i", {"text": 42})).text == "42!"
    assert (await pick.execute("i", {"choice": 2, "note": True})).text == "2 true"


async def test_injected_parameters_come_from_execute_kwargs() -> None:
    @tool(injected=["ground_truth"])
    def check(answer: str, ground_truth: str) -> ToolOutput:
        """Check an answer."""
        return ToolOutput("ok", reward=float(answer == ground_truth))

    assert list(check.schema["function"]["parameters"]["properties"]) == ["answer"]
    out = await check.execute("i", {"answer": "4"}, ground_truth="4", unrelated=1)
    assert out.reward == 1.0
    with pytest.raises(ToolArgumentError, match="unknown argument"):
        await check.execute("i", {"answer": "4", "ground_truth": "4"})


def test_as_tool_output_normalizes_results() -> None:
    assert as_tool_output("x") == ToolOutput("x")
    assert as_tool_output(("x", 0.5, {"m": 1})) == ToolOutput("x", 0.5, {"m": 1})
    assert as_tool_output(("x", 1)) == ToolOutput("x", 1.0)
    assert as_tool_output({"text": "t", "image": []}) == ToolOutput("t")
    assert as_tool_output([1, 2]) == ToolOutput("[1, 2]")
    assert as_tool_output(None) == ToolOutput("")
    out = ToolOutput("y")
    assert as_tool_output(out) is out


def test_base_tool_schema_and_defaults() -> None:
    class Bare(BaseTool):
        async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> str:
            return ""

    bare = Bare(tool_schema={"name": "bare", "description": "d", "parameters": {"type": "object"}})
    assert bare.schema["type"] == "function"
    assert bare.name == "bare"
    assert not bare.overrides_calc_reward()
    with pytest.raises(ValueError, match="no tool schema"):
        _ = Bare().schema
    with pytest.raises(ValueError, match="no function name"):
        Bare(tool_schema={"type": "function", "function": {"description": "d"}})


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-2 ** 2", "-4"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("7 % 3", "1"),
    ],
)
def test_calculator(expression: str, expected: str) -> None:
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression", ["x + 1", "__import__('os')", "2 **", "9 ** 9 ** 9", "True + 1", "[1]"]
)
def test_calculator_refuses_anything_but_arithmetic(expression: str) -> None:
    with pytest.raises(ValueError):
        calculator(expression)


class _Cycle:
    """Garbage with a finalizer: a collection during a parse runs Python code, where threads switch."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        sum(range(20))


def test_the_calculator_and_pythonic_calls_parse_in_many_threads_at_once() -> None:
    """Plain-function tools run in worker threads while the tool-call parsers run on the loop. On
    Python 3.11 two ``ast.parse`` at once fail about one time in seven (``SystemError: AST
    constructor recursion depth mismatch``, CPython gh-106905) when threads switch midway."""
    from turnrl.tools.pythonic_parsers import pythonic_calls

    deep = "(" * 20 + "1 + 2" + ")" * 20 + " * 3 + " + " + ".join(str(i) for i in range(40))
    nested = "[" * 20 + ", ".join(str(i) for i in range(40)) + "]" * 20
    errors: list[str] = []

    def work(k: int) -> None:
        for _ in range(600):
            [_Cycle() for _ in range(3)]
            try:
                if k % 2:
                    assert calculator(deep) == "789"
                else:
                    (call,) = pythonic_calls(f"[f(a={nested}, b='x')]", "")
                    assert not isinstance(call, str), call
            except SystemError as exc:
                errors.append(str(exc))

    switch, threshold = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-5)  # threads switch as often as on a busy machine, at every chance
    gc.set_threshold(50)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
        gc.set_threshold(*threshold)
    assert errors == []


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


MY_TOOLS = '''
from turnrl.tools import BaseTool


class Counter(BaseTool):
    """Counts calls per trajectory."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema)
        self.counts = {}

    async def create(self, instance_id, **kwargs):
        self.counts[instance_id] = kwargs.get("start", 0)

    async def execute(self, instance_id, parameters, **kwargs):
        self.counts[instance_id] += self.config.get("step", 1)
        return str(self.counts[instance_id]), 0.0, {}


def shout(text: str) -> str:
    """Shout a text.

    Args:
        text: What to shout.
    """
    return text.upper()


NOT_A_TOOL = 3
'''


@pytest.fixture
def tools_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"my_tools_{tmp_path.name.replace('-', '_')}"
    _write(tmp_path / f"{name}.py", MY_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


async def test_load_tools_config_from_yaml(tmp_path: Path, tools_module: str) -> None:
    path = _write(
        tmp_path / "tools.yaml",
        f"""
        tools:
          - class_name: "{tools_module}.Counter"
            config: {{step: 2}}
            tool_schema:
              type: function
              function:
                name: count
                description: Count.
                parameters: {{type: object, properties: {{}}, required: []}}
          - class_name: "{tools_module}.shout"
          - class_name: turnrl.tools.builtin.calculator
            tool_schema:
              type: function
              function: {{name: calc, description: Arithmetic., parameters: {{type: object}}}}
        """,
    )
    counter, shout, calc = load_tools_config(path)
    assert [t.name for t in (counter, shout, calc)] == ["count", "shout", "calc"]
    assert counter.config == {"step": 2}
    await counter.create("a", start=10)
    assert (await counter.execute("a", {})) == ("12", 0.0, {})
    assert isinstance(shout, FunctionTool)
    assert shout.schema["function"]["parameters"]["properties"]["text"]["description"] == "What to shout."
    assert (await shout.execute("a", {"text": "hi"})).text == "HI"
    assert as_tool_output(await calc.execute("a", {"expression": "6 * 7"})).text == "42"


def test_load_tools_config_accepts_a_dict() -> None:
    (calc,) = load_tools_config({"tools": [{"class_name": "turnrl.tools.builtin.calculator"}]})
    assert calc.name == "calculator"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"class_name": "no_such_pkg.mod.Tool"}, "'no_such_pkg.mod.Tool': no module named 'no_such_pkg'"),
        ({"class_name": "turnrl.tools.builtin.Missing"}, "module 'turnrl.tools.builtin' has no 'Missing'"),
        ({"class_name": "Tool"}, "is not of the form module:name"),
        ({"config": {}}, "tools[0] needs a 'class_name'"),
        (
            {
                "class_name": "turnrl.tools.builtin.calculator",
                "tool_schema": {"type": "function", "function": {}},
            },
            "tool_schema is missing function.name",
        ),
    ],
)
def test_load_tools_config_errors(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ToolConfigError) as excinfo:
        load_tools_config({"tools": [entry]})
    assert message in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_load_tools_config_file_errors(tmp_path: Path, tools_module: str) -> None:
    with pytest.raises(ToolConfigError, match="tool config file not found"):
        load_tools_config(tmp_path / "missing.yaml")
    with pytest.raises(ToolConfigError, match="has no tool schema"):
        load_tools_config({"tools": [{"class_name": f"{tools_module}.Counter"}]})
    with pytest.raises(ToolConfigError, match="neither a BaseTool subclass nor a function"):
        load_tools_config({"tools": [{"class_name": f"{tools_module}.NOT_A_TOOL"}]})
    calc = {"class_name": "turnrl.tools.builtin.calculator"}
    with pytest.raises(ToolConfigError, match="duplicate tool name"):
        load_tools_config({"tools": [calc, calc]})
    with pytest.raises(ToolConfigError, match="needs a 'tools' list"):
        load_tools_config(_write(tmp_path / "empty.yaml", ""))
