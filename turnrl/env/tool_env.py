"""An env whose actions are tool calls: parse them, run them concurrently, answer with tool messages."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.env.base import Env
from turnrl.env.caps import cap_text
from turnrl.env.interaction import Interaction, call_optional, choose
from turnrl.support.errors import describe
from turnrl.tools.base import BaseTool, ToolCall, ToolError, ToolOutput, as_tool_output
from turnrl.tools.parsers import ToolParser, get_parser
from turnrl.types import Message, Sample, StepResult, StopReason, Trajectory

logger = logging.getLogger(__name__)


@dataclass
class _CallResult:
    """What one call produced: its output, and whether it failed."""

    output: ToolOutput
    failed: bool = False


class ToolEnv(Env):
    """Runs the tool calls of each model turn; a turn without any call ends the episode.

    Tools follow verl's lifecycle: ``create`` once per trajectory in ``reset``, ``execute`` per call,
    ``calc_reward`` in ``score`` (when a tool implements it), ``release`` in ``close``. A call whose
    ``ToolOutput`` says ``done`` ends the episode (``env_done``) after the turn's calls. Per tool,
    ``sample.tools_kwargs[name]`` may hold ``create_kwargs``, ``execute_kwargs``, ``calc_reward_kwargs``
    and ``release_kwargs``. Errors of a call (unknown tool, bad arguments, exception, timeout) and
    malformed calls become ``Error: ...`` tool messages for the model, never exceptions.
    """

    tools: list[dict[str, Any]]  # the schemas of the tools this sample may use

    def __init__(
        self,
        sample: Sample,
        tools: Sequence[BaseTool],
        parser: str | ToolParser = "hermes",
        max_parallel_calls: int = 8,
        tool_timeout_s: float | None = 30.0,
        max_calls_per_turn: int = 16,
        max_output_chars: int | None = 16_000,
        interactions: Mapping[str, Interaction] | None = None,
    ) -> None:
        """``max_output_chars`` caps the text of one tool result: a longer one keeps its start and
        its end, and says in the middle how much was cut (None: no cap). ``interactions``: simulated
        users by name (``turnrl.env.interaction``); the row's ``interaction_kwargs`` picks one, and
        it answers every turn without a tool call instead of ending the episode."""
        super().__init__(sample)
        self._user: tuple[Interaction, dict[str, Any]] | None = (
            choose(interactions, sample) if interactions else None
        )
        self._conversation: list[Message] = []  # what a simulated user is shown: the whole exchange
        self._tools = select_tools(tools, sample)
        self.tools = [tool.schema for tool in self._tools.values()]
        self.parser = get_parser(parser) if isinstance(parser, str) else parser
        self.max_parallel_calls = max_parallel_calls
        self.tool_timeout_s = tool_timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        self.max_output_chars = max_output_chars
        self.instance_id = f"{sample.id}/{uuid.uuid4().hex}"  # unique per trajectory
        self._created: list[BaseTool] = []

    async def reset(self) -> list[Message]:
        """Create every selected tool's instance for this trajectory; return the sample's prompt."""
        for name, tool in self._tools.items():
            await tool.create(self.instance_id, **self._kwargs(name, "create_kwargs"))
            self._created.append(tool)
        if self._user is not None:
            user, kwargs = self._user
            await user.start_interaction(self.instance_id, **kwargs)
            self._conversation = list(self.sample.prompt)
        return list(self.sample.prompt)

    async def step(self, action: str) -> StepResult:
        """Parse the turn's tool calls, run them concurrently and return their tool messages."""
        parsed = self.parser.parse(action)
        if self._user is not None:  # what the simulated user is shown
            self._conversation.append({"role": "assistant", "content": action})
        if not parsed.calls and not parsed.errors:
            if self._user is not None:
                return await self._user_turn()
            return StepResult(observation=None, done=True, stop_reason=StopReason.NO_TOOL_CALL)
        allowed, skipped = parsed.calls[: self.max_calls_per_turn], parsed.calls[self.max_calls_per_turn :]
        results = await self._run_calls(allowed)
        cut = [_cap(r, self.max_output_chars) for r in results]
        messages = [
            _tool_message(c.name, c.id, r.output.text, r.output.images)
            for c, r in zip(allowed, results, strict=True)
        ]
        if skipped:  # one message for all of them: 1,000 calls must not make 1,000 observations
            limit = (
                f"{len(skipped)} more tool calls in this turn were not run (max {self.max_calls_per_turn})"
            )
            messages.append(_tool_message(skipped[0].name, skipped[0].id, f"Error: {limit}"))
        messages += [_tool_message("", f"error{i:04d}", f"Error: {e}") for i, e in enumerate(parsed.errors)]
        info = {
            "tool_calls": [{"name": c.name, "arguments": c.arguments, "id": c.id} for c in parsed.calls],
            "num_tool_calls": len(parsed.calls),
            # every call that did not give a result: failed, not run, or malformed (a parse error)
            "num_tool_errors": sum(r.failed for r in results) + len(skipped) + len(parsed.errors),
            "num_parse_errors": len(parsed.errors),  # of which malformed calls, answered with their error
            "num_truncated_outputs": sum(cut),  # results longer than max_output_chars
            "parse_errors": list(parsed.errors),
            "tool_metrics": [r.output.metrics for r in results],
        }
        if self._user is not None:
            self._conversation += messages
        done = any(r.output.done for r in results)  # a call that ends the episode (a solved puzzle)
        reward = sum(r.output.reward for r in results)
        return StepResult(observation=messages, reward=reward, done=done, info=info)

    async def _user_turn(self) -> StepResult:
        """The simulated user's answer to a turn without tool calls (verl's ``generate_response``)."""
        assert self._user is not None
        user, kwargs = self._user
        conversation = [dict(m) for m in self._conversation]
        result = await user.generate_response(self.instance_id, conversation, **kwargs)
        terminate, text, score, meta = _interaction_reply(result, user.name)
        stop = StopReason.ENV_DONE if terminate else None
        if terminate and not text:  # the user ends without a message (its turns are used up)
            info = {"interaction": user.name, "num_user_turns": 0, "interaction_meta": meta}
            return StepResult(observation=None, reward=score, done=True, info=info, stop_reason=stop)
        message: Message = {"role": "user", "content": text}
        self._conversation.append(message)
        info = {"interaction": user.name, "num_user_turns": 1, "interaction_meta": meta}
        return StepResult(observation=[message], reward=score, done=terminate, info=info, stop_reason=stop)

    def format_observation(self, observation: Any) -> list[Message]:
        """The tool messages of the turn, as they are."""
        return list(observation)

    async def score(self, trajectory: Trajectory) -> float | None:
        """The sum of ``calc_reward`` over the tools that implement it, or None when none does."""
        scorers = [(name, t) for name, t in self._tools.items() if t.overrides_calc_reward()]
        user_score = None
        if self._user is not None:
            user, kwargs = self._user
            user_score = await call_optional(user, "calculate_score", self.instance_id, kwargs)
        if not scorers and user_score is None:
            return None
        rewards = [
            await t.calc_reward(self.instance_id, **self._kwargs(n, "calc_reward_kwargs")) for n, t in scorers
        ]
        return float(sum(rewards)) + float(user_score or 0.0)

    async def close(self) -> None:
        """Release every created tool instance; release errors are logged, not raised."""
        if self._user is not None:
            user, kwargs = self._user
            try:
                await call_optional(user, "finalize_interaction", self.instance_id, kwargs)
            except Exception:
                logger.exception(
                    "finalizing interaction '%s' (instance %s) failed", user.name, self.instance_id
                )
        created, self._created = self._created, []
        for tool in reversed(created):
            try:
                await tool.release(self.instance_id, **self._kwargs(tool.name, "release_kwargs"))
            except Exception:
                logger.exception("releasing tool '%s' (instance %s) failed", tool.name, self.instance_id)

    async def _run_calls(self, calls: list[ToolCall]) -> list[_CallResult]:
        """Run the calls concurrently, at most ``max_parallel_calls`` at a time, results in call order."""
        semaphore = asyncio.Semaphore(self.max_parallel_calls)
        return list(await asyncio.gather(*(self._run_call(call, semaphore) for call in calls)))

    async def _run_call(self, call: ToolCall, semaphore: asyncio.Semaphore) -> _CallResult:
        """Run one call; every failure becomes an error text for the model."""
        tool = self._tools.get(call.name)
        if tool is None:
            available = ", ".join(self._tools) or "none"
            return _error(f"Error: unknown tool '{call.name}'; available tools: {available}")
        kwargs = self._kwargs(call.name, "execute_kwargs")
        timeout = asyncio.timeout(self.tool_timeout_s)
        try:
            async with semaphore, timeout:
                raw = await tool.execute(self.instance_id, call.arguments, **kwargs)
            return _CallResult(as_tool_output(raw))
        except ToolError as e:  # bad arguments, or a failure the tool explains itself
            return _error(f"Error: {e}")
        except Exception as e:
            if isinstance(e, TimeoutError) and timeout.expired():
                return _error(f"Error: tool '{call.name}' timed out after {self.tool_timeout_s:g} s")
            logger.debug("tool '%s' raised", call.name, exc_info=True)
            return _error(f"Error: tool '{call.name}' raised {describe(e)}")

    def _kwargs(self, tool_name: str, key: str) -> dict[str, Any]:
        """``sample.tools_kwargs[tool_name][key]``, or an empty dict."""
        return dict((self.sample.tools_kwargs.get(tool_name) or {}).get(key) or {})


def select_tools(tools: Sequence[BaseTool], sample: Sample) -> dict[str, BaseTool]:
    """The tools a sample may use, by name: all of them, or those named in ``sample.tools``."""
    by_name: dict[str, BaseTool] = {}
    for tool in tools:
        if tool.name in by_name:
            raise ValueError(f"two tools are named '{tool.name}'")
        by_name[tool.name] = tool
    if sample.tools is None:
        return by_name
    unknown = [name for name in sample.tools if name not in by_name]
    if unknown:
        available = ", ".join(by_name) or "none"
        raise ValueError(f"sample '{sample.id}' asks for unknown tool(s) {unknown}; available: {available}")
    return {name: by_name[name] for name in dict.fromkeys(sample.tools)}


def _interaction_reply(result: Any, name: str) -> tuple[bool, str, float, dict[str, Any]]:
    """verl's ``(terminate, text, turn_score, meta)``, checked."""
    if not isinstance(result, tuple | list) or len(result) != 4:
        raise TypeError(
            f"interaction '{name}' returned {type(result).__name__}, expected (done, text, score, meta)"
        )
    terminate, text, score, meta = result
    if not isinstance(text, str):
        raise TypeError(f"interaction '{name}' answered with {type(text).__name__}, expected text")
    return bool(terminate), text, float(score or 0.0), dict(meta or {})


def _tool_message(name: str, call_id: str, text: str, images: Sequence[Any] = ()) -> Message:
    """A tool message; with images, its content is the image parts then the text."""
    content: Any = text
    if images:
        content = [*({"type": "image", "image": image} for image in images), {"type": "text", "text": text}]
    return {"role": "tool", "name": name, "tool_call_id": call_id, "content": content}


def _cap(result: _CallResult, limit: int | None) -> bool:
    """Cap the result's text (a new ToolOutput: the tool's own is left alone); whether it was cut."""
    if limit is None or len(result.output.text) <= limit:
        return False
    result.output = dataclasses.replace(result.output, text=cap_text(result.output.text, limit))
    return True


def _error(text: str) -> _CallResult:
    return _CallResult(ToolOutput(text), failed=True)
