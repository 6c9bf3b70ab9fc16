"""ToolEnv: lifecycle, concurrent calls, error observations, per-sample tools and kwargs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from turnrl.env.tool_env import ToolEnv
from turnrl.tools import BaseTool, ToolOutput, calculator, tool
from turnrl.types import Sample, StopReason, Trajectory

PROMPT = [{"role": "user", "content": "What is 6 * 7?"}]


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def make_sample(**kwargs: Any) -> Sample:
    return Sample(id="s0", prompt=PROMPT, **kwargs)


def trajectory() -> Trajectory:
    return Trajectory(
        id="s0/0", group_id="s0", data_source="default", stop_reason=StopReason.ENV_DONE,
    )  # fmt: skip


class Recorder(BaseTool):
    """Records the lifecycle; answers with the instance's state and the kwargs it got."""

    def __init__(self, name: str = "rec", fail_on: str = "") -> None:
        super().__init__(
            tool_schema={"name": name, "description": "Record.", "parameters": {"type": "object"}}
        )
        self.fail_on = fail_on
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.state: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        self._event("create", instance_id, kwargs)
        self.state[instance_id] = dict(kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        self._event("execute", instance_id, kwargs)
        return json.dumps({"state": self.state[instance_id], "kwargs": kwargs}), 0.25, {"calls": 1}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        self._event("calc_reward", instance_id, kwargs)
        return 2.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._event("release", instance_id, kwargs)
        self.state.pop(instance_id)

    def _event(self, kind: str, instance_id: str, kwargs: dict[str, Any]) -> None:
        self.events.append((kind, instance_id, kwargs))
        if kind == self.fail_on:
            raise RuntimeError(f"{kind} failed")


@tool
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


async def test_no_tool_call_ends_the_episode() -> None:
    env = ToolEnv(make_sample(), [tool(calculator)])
    assert await env.reset() == PROMPT
    result = await env.step("<think>easy</think>The answer is 42.")
    assert result.done and result.stop_reason is StopReason.NO_TOOL_CALL
    await env.close()


async def test_tool_call_gives_a_tool_message() -> None:
    env = ToolEnv(make_sample(), [tool(calculator)])
    assert env.tools == [tool(calculator).schema]
    await env.reset()
    result = await env.step("Let me compute. " + call("calculator", expression="6 * 7"))
    assert not result.done
    assert result.observation == [
        {"role": "tool", "name": "calculator", "tool_call_id": "call00000", "content": "42"}
    ]
    assert env.format_observation(result.observation) == result.observation
    assert result.info["tool_calls"] == [
        {"name": "calculator", "arguments": {"expression": "6 * 7"}, "id": "call00000"}
    ]
    assert result.info["num_tool_calls"] == 1
    assert result.info["num_tool_errors"] == 0
    assert result.info["parse_errors"] == []
    assert await env.score(trajectory()) is None  # no tool implements calc_reward
    await env.close()


async def test_calls_of_a_turn_run_concurrently() -> None:
    started = {"a": asyncio.Event(), "b": asyncio.Event()}
    order: list[str] = []

    def waiter(me: str, other: str) -> Any:
        async def wait() -> str:
            order.append(f"start {me}")
            started[me].set()
            await started[other].wait()  # deadlocks (then times out) unless both run at once
            await asyncio.sleep(0.3)
            order.append(f"end {me}")
            return me

        wait.__name__ = me
        return tool(wait)

    env = ToolEnv(make_sample(), [waiter("a", "b"), waiter("b", "a")], tool_timeout_s=5.0)
    await env.reset()
    result = await env.step(call("a") + call("b"))
    assert [m["content"] for m in result.observation] == ["a", "b"]
    assert order[:2] == ["start a", "start b"]
    assert result.info["num_tool_errors"] == 0


async def test_max_parallel_calls_bounds_concurrency() -> None:
    running = 0
    peak = 0

    @tool
    async def slow() -> str:
        """Sleep a little."""
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return "done"

    env = ToolEnv(make_sample(), [slow], max_parallel_calls=2)
    result = await env.step(call("slow") * 5)
    assert [m["content"] for m in result.observation] == ["done"] * 5
    assert peak == 2


async def test_malformed_call_becomes_an_error_observation() -> None:
    env = ToolEnv(make_sample(), [tool(calculator)])
    result = await env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1"</tool_call>')
    assert not result.done
    (message,) = result.observation
    assert message["role"] == "tool"
    assert message["content"].startswith("Error: invalid JSON in <tool_call>:")
    assert result.info["parse_errors"] and result.info["num_tool_calls"] == 0
    assert result.info["num_parse_errors"] == 1


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (call("divide", a=1, b=0), "Error: tool 'divide' raised ZeroDivisionError: division by zero"),
        (call("divide", a=1), "Error: tool 'divide' is missing required argument(s) 'b'"),
        (call("divide", a=1, b=2, c=3), "Error: tool 'divide' got unknown argument(s) 'c'; it takes: a, b"),
        (call("multiply", a=1), "Error: unknown tool 'multiply'; available tools: divide"),
    ],
)
async def test_call_errors_become_error_observations(action: str, expected: str) -> None:
    env = ToolEnv(make_sample(), [divide])
    result = await env.step(action)
    assert [m["content"] for m in result.observation] == [expected]
    assert result.info["num_tool_errors"] == 1
    assert result.reward == 0.0


async def test_timeout_becomes_an_error_observation() -> None:
    @tool
    async def hang() -> str:
        """Never answer."""
        await asyncio.sleep(10)
        return "late"

    env = ToolEnv(make_sample(), [hang, divide], tool_timeout_s=0.05)
    result = await env.step(call("hang") + call("divide", a=1, b=4))
    assert [m["content"] for m in result.observation] == ["Error: tool 'hang' timed out after 0.05 s", "0.25"]
    assert result.info["num_tool_errors"] == 1


async def test_a_tools_own_timeout_error_is_not_reported_as_the_envs() -> None:
    @tool
    def fetch() -> str:
        """Fetch a page."""
        raise TimeoutError("server did not answer")

    env = ToolEnv(make_sample(), [fetch])
    result = await env.step(call("fetch"))
    assert (
        result.observation[0]["content"] == "Error: tool 'fetch' raised TimeoutError: server did not answer"
    )


async def test_too_many_calls_in_one_turn() -> None:
    env = ToolEnv(make_sample(), [divide], max_calls_per_turn=2)
    result = await env.step(call("divide", a=1, b=1) * 5)
    contents = [m["content"] for m in result.observation]
    assert contents == ["1.0", "1.0", "Error: 3 more tool calls in this turn were not run (max 2)"]
    assert result.info["num_tool_calls"] == 5 and result.info["num_tool_errors"] == 3


async def test_lifecycle_rewards_and_tools_kwargs() -> None:
    rec = Recorder()
    tools_kwargs = {
        "rec": {
            "create_kwargs": {"ground_truth": "42"},
            "execute_kwargs": {"mode": "strict"},
            "calc_reward_kwargs": {"weight": 1},
            "release_kwargs": {"cleanup": True},
        }
    }
    env = ToolEnv(make_sample(tools_kwargs=tools_kwargs), [rec])
    await env.reset()
    result = await env.step(call("rec") + call("rec"))
    assert json.loads(result.observation[0]["content"]) == {
        "state": {"ground_truth": "42"},
        "kwargs": {"mode": "strict"},
    }
    assert result.reward == 0.5
    assert result.info["tool_metrics"] == [{"calls": 1}, {"calls": 1}]
    assert await env.score(trajectory()) == 2.0
    await env.close()
    await env.close()  # closing twice releases once
    kinds = [(kind, kwargs) for kind, _, kwargs in rec.events]
    assert kinds == [
        ("create", {"ground_truth": "42"}),
        ("execute", {"mode": "strict"}),
        ("execute", {"mode": "strict"}),
        ("calc_reward", {"weight": 1}),
        ("release", {"cleanup": True}),
    ]
    assert len({instance_id for _, instance_id, _ in rec.events}) == 1
    assert rec.state == {}


async def test_each_trajectory_gets_its_own_instance() -> None:
    rec = Recorder()
    envs = [ToolEnv(make_sample(), [rec]) for _ in range(2)]
    for env in envs:
        await env.reset()
    assert len(rec.state) == 2
    for env in envs:
        await env.close()
    assert rec.state == {}


async def test_release_runs_when_a_later_create_fails() -> None:
    good, bad = Recorder("good"), Recorder("bad", fail_on="create")
    env = ToolEnv(make_sample(), [good, bad])
    with pytest.raises(RuntimeError, match="create failed"):
        await env.reset()
    await env.close()
    assert [kind for kind, _, _ in good.events] == ["create", "release"]
    assert [kind for kind, _, _ in bad.events] == ["create"]  # never created, so never released


async def test_release_errors_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    first, failing = Recorder("first"), Recorder("failing", fail_on="release")
    env = ToolEnv(make_sample(), [first, failing])
    await env.reset()
    await env.close()
    assert [kind for kind, _, _ in first.events][-1] == "release"
    assert "releasing tool 'failing'" in caplog.text


async def test_release_runs_after_a_step_error() -> None:
    rec = Recorder(fail_on="execute")
    env = ToolEnv(make_sample(), [rec])
    await env.reset()
    result = await env.step(call("rec"))
    assert result.observation[0]["content"] == "Error: tool 'rec' raised RuntimeError: execute failed"
    await env.close()
    assert [kind for kind, _, _ in rec.events] == ["create", "execute", "release"]


async def test_per_sample_tool_selection() -> None:
    a, b = Recorder("a"), Recorder("b")
    env = ToolEnv(make_sample(tools=["b"]), [a, b])
    assert [s["function"]["name"] for s in env.tools] == ["b"]
    await env.reset()
    result = await env.step(call("a"))
    assert result.observation[0]["content"] == "Error: unknown tool 'a'; available tools: b"
    await env.close()
    assert a.events == []
    with pytest.raises(ValueError, match="unknown tool\\(s\\) \\['c'\\]; available: a, b"):
        ToolEnv(make_sample(tools=["c"]), [a, b])


def test_duplicate_tool_names_are_refused() -> None:
    with pytest.raises(ValueError, match="two tools are named 'a'"):
        ToolEnv(make_sample(), [Recorder("a"), Recorder("a")])


async def test_other_parsers() -> None:
    env = ToolEnv(make_sample(), [tool(calculator)], parser="qwen3_coder")
    text = "<tool_call>\n<function=calculator>\n<parameter=expression>\n2 ** 10\n</parameter>\n</function>\n"
    text += "</tool_call>"
    assert (await env.step(text)).observation[0]["content"] == "1024"
    env = ToolEnv(make_sample(), [tool(calculator)], parser="llama3_json")
    result = await env.step('<|python_tag|>{"name": "calculator", "parameters": {"expression": "3 - 5"}}')
    assert result.observation[0]["content"] == "-2"


async def test_tool_output_rewards_are_summed() -> None:
    @tool
    def reward(value: float) -> ToolOutput:
        """Give a reward."""
        return ToolOutput("ok", reward=value)

    env = ToolEnv(make_sample(), [reward])
    result = await env.step(call("reward", value=0.5) + call("reward", value=1.5))
    assert result.reward == 2.0


async def test_a_huge_tool_result_is_cut_to_the_cap_and_the_cut_is_said() -> None:
    huge = "A" * 5_000_000 + "B" * 5_000_000  # 10 MB

    @tool
    def dump() -> str:
        """Return far too much."""
        return huge

    env = ToolEnv(make_sample(), [dump, divide], max_output_chars=1000)
    result = await env.step(call("dump") + call("divide", a=1, b=4))
    text = result.observation[0]["content"]
    assert text.startswith("A" * 500) and text.endswith("B" * 500) and len(text) < 1100
    assert "[... 9999000 characters cut: the output had 10000000, 1000 are shown ...]" in text
    assert result.observation[1]["content"] == "0.25"  # a short result is left as it is
    assert result.info["num_truncated_outputs"] == 1 and result.info["num_tool_errors"] == 0
    uncapped = ToolEnv(make_sample(), [dump], max_output_chars=None)
    assert (await uncapped.step(call("dump"))).observation[0]["content"] == huge
