"""OpenEnv environments (``openenv-core``) as turnrl envs, with exact tokens.

An OpenEnv env runs in its own server (a container, a Hugging Face Space, or ``uvicorn`` on a
laptop) and is played over its WebSocket protocol: one session per trajectory, holding that
episode's env. This adapter speaks the protocol with an asyncio WebSocket client (OpenEnv's own
client is synchronous: a thread per waiting call would cap how many episodes run at once).

Two styles, picked per server (``mode: auto``):

- **tools** (OpenEnv's MCP envs): the server's tools (MCP ``tools/list``) are shown to the model as
  functions; each parsed tool call is one ``step(CallToolAction)``, its result the tool message, its
  ``reward`` the turn's reward and its ``done`` the end of the episode (``env_done``). Malformed
  calls, unknown tools and tool errors are tool messages for the model, as with any tool env.
- **action** (classic envs): the model's text is the action's ``action_field`` (``message`` by
  default), and the observation's ``observation_field`` (default: its only text field, else the
  observation as JSON) is the next user message. An action the server rejects is said to the
  model and counted as ``invalid_actions``.

Mapping: ``reset(seed, episode_id, **reset_kwargs)`` takes the row's ``seed`` (or the
trajectory's env seed) and the row's ``reset_kwargs``; its observation, when it has text, follows
the row's prompt as a user message. Step rewards are summed into the trajectory's reward (unless a
reward function is routed); the observation's other fields land in the turn's info and the
server's ``state`` (``episode_id``, ``step_count``) in the trajectory's info. What does not carry
over: an observation's ``metadata`` (OpenEnv's server does not send it), image observations, and
OpenEnv's CodeAct mode (code actions that call several tools; use a code tool instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from turnrl.env.tool_env import ToolEnv, select_tools
from turnrl.tools.base import BaseTool, ToolError, ToolOutput
from turnrl.types import Message, Sample, StepResult, Trajectory

MODES = ("auto", "tools", "action")
SYSTEM = "You are an agent in an environment. Each turn, act on what the environment last said."


class OpenEnvError(RuntimeError):
    """An OpenEnv server that cannot be reached, refused a request, or closed the session."""


class OpenEnvSession:
    """One WebSocket session with an OpenEnv server: requests answered in order, one at a time."""

    def __init__(self, url: str, message_timeout_s: float = 60.0, capacity_wait_s: float = 300.0) -> None:
        base = url.rstrip("/")
        for http, ws in (("https://", "wss://"), ("http://", "ws://")):
            if base.startswith(http):
                base = ws + base[len(http) :]
        self.url = base if base.endswith("/ws") else f"{base}/ws"
        self.message_timeout_s = message_timeout_s
        self.capacity_wait_s = capacity_wait_s
        self._ws: Any = None
        self._lock = asyncio.Lock()
        self._next_id = 0
        self.broken: OpenEnvError | None = None  # the session is gone (the episode cannot go on)

    async def start(self, reset: dict[str, Any]) -> dict[str, Any]:
        """Open the session and reset its env; while the server is full, wait for a free session."""
        await self.close()  # a retried reset starts a fresh session
        self.broken = None
        deadline = time.monotonic() + self.capacity_wait_s
        pause = 0.1
        while True:
            await self._connect()
            reply = await self._exchange({"type": "reset", "data": reset})
            if reply.get("type") != "error" or reply.get("data", {}).get("code") != "CAPACITY_REACHED":
                return self._data(reply, "reset")
            await self.close()
            if time.monotonic() + pause > deadline:
                full = reply["data"].get("max_sessions")
                raise OpenEnvError(
                    f"OpenEnv server {self.url} stayed full ({full} sessions) for {self.capacity_wait_s:g} s:"
                    " raise its max_concurrent_envs or lower rollout.concurrency"
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        """One ``step``: the server's ``{observation, reward, done}``."""
        return self._data(await self._exchange({"type": "step", "data": action}), "step")

    async def state(self) -> dict[str, Any]:
        """The env's ``state`` (``episode_id``, ``step_count``...)."""
        return self._data(await self._exchange({"type": "state"}), "state")

    async def list_tools(self) -> list[dict[str, Any]] | None:
        """The env's MCP tools, or None when the env is not an MCP env."""
        self._next_id += 1
        request = {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": self._next_id}
        answer = self._data(await self._exchange({"type": "mcp", "data": request}), "tools/list")
        if "error" in answer:
            return None
        return list(answer.get("result", {}).get("tools", []))

    async def close(self) -> None:
        """Say goodbye (the server then ends the env's session) and close the socket."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            if self.broken is None:  # a session out of step (or gone) gets no goodbye
                with contextlib.suppress(Exception):
                    await ws.send(json.dumps({"type": "close"}))
                    await ws.close()
        finally:  # also when the close itself is cut off: the socket never outlives the episode
            ws.transport.abort()

    async def _connect(self) -> None:
        from websockets.asyncio.client import connect

        try:
            self._ws = await connect(self.url, open_timeout=self.message_timeout_s, max_size=None)
        except (OSError, TimeoutError) as e:
            raise OpenEnvError(f"cannot reach the OpenEnv server at {self.url}: {e}") from e

    async def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request, return its reply as it came (an error reply too); a lost, silent or
        cut-off session raises and marks the session broken."""
        from websockets.exceptions import ConnectionClosed

        if self.broken is not None:  # a step is not retried on a lost session: the episode is over
            raise self.broken
        if self._ws is None:
            raise OpenEnvError(f"the session with {self.url} is closed")
        what = message["type"]
        async with self._lock:
            try:
                with contextlib.suppress(ConnectionClosed):  # a server that hung up may have said why
                    await self._ws.send(json.dumps(message))
                async with asyncio.timeout(self.message_timeout_s):
                    raw = await self._ws.recv()
            except TimeoutError:
                self.broken = OpenEnvError(
                    f"OpenEnv server {self.url}: no answer to {what} in {self.message_timeout_s:g} s"
                )
                raise self.broken from None
            except ConnectionClosed as e:
                self.broken = OpenEnvError(f"OpenEnv server {self.url} closed the session during {what}: {e}")
                raise self.broken from None
            except asyncio.CancelledError:  # its answer may still come and would answer the next request
                self.broken = OpenEnvError(
                    f"OpenEnv server {self.url}: {what} was cut off (env_timeout_s) before its answer; "
                    "the session is out of step, so the episode ends"
                )
                raise
        return dict(json.loads(raw))

    def _data(self, reply: dict[str, Any], what: str) -> dict[str, Any]:
        """The reply's data; an error reply raises, but a step's rejected action (a validation
        error: the model's fault, said to it) is returned as it came."""
        if reply.get("type") != "error":
            return dict(reply.get("data") or {})
        if what == "step" and reply.get("data", {}).get("code") == "VALIDATION_ERROR":
            return reply
        raise OpenEnvError(f"OpenEnv server {self.url} refused {what}: {_error_text(reply)}")


def _error_text(reply: dict[str, Any]) -> str:
    """An error reply in one line: its message, and the first validation error."""
    data = reply.get("data") or {}
    text = str(data.get("message") or data.get("code") or "error")
    for error in data.get("errors") or []:
        place = ".".join(str(p) for p in error.get("loc") or []) or "action"
        return f"{text}: {place}: {error.get('msg')}"
    return text


class OpenEnvTool(BaseTool):
    """One MCP tool of an OpenEnv env, called as a ``step`` of the trajectory's session."""

    def __init__(self, session: OpenEnvSession, tool: dict[str, Any]) -> None:
        import mcp.types

        from turnrl.tools.mcp import function_schema

        spec = mcp.types.Tool.model_validate(tool)
        super().__init__(tool_schema=function_schema(spec))
        self.session = session
        self.remote_name = spec.name

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolOutput:
        """A ``CallToolAction`` step: the result's text and images, the step's reward and ``done``."""
        import mcp.types

        from turnrl.tools.mcp import result_content

        action = {"type": "call_tool", "tool_name": self.remote_name, "arguments": parameters}
        reply = await self.session.step(action)
        if reply.get("type") == "error":
            raise ToolError(_error_text(reply))
        observation = reply.get("observation") or {}
        if observation.get("error"):
            raise ToolError(str(observation["error"].get("message") or observation["error"]))
        result = mcp.types.CallToolResult.model_validate(observation.get("result") or {"content": []})
        text, images = result_content(result)
        if result.is_error:
            raise ToolError(text or f"tool '{self.remote_name}' failed")
        reward = float(reply.get("reward") or 0.0)
        return ToolOutput(text, reward=reward, images=images, done=bool(reply.get("done")))


class OpenEnvEnv(ToolEnv):
    """One OpenEnv session per trajectory (``url``: the server); see the module doc."""

    def __init__(
        self,
        sample: Sample,
        url: str | list[str] = "http://127.0.0.1:8000",
        mode: str = "auto",
        action_field: str = "message",
        observation_field: str | None = None,
        reset_kwargs: dict[str, Any] | None = None,
        message_timeout_s: float = 60.0,
        capacity_wait_s: float = 300.0,
        **tool_env_kwargs: Any,
    ) -> None:
        """``tool_env_kwargs`` (``parser``, ``max_calls_per_turn``, ``tool_timeout_s``...) apply in
        the tools style."""
        if mode not in MODES:
            raise ValueError(f"OpenEnv mode must be one of {', '.join(MODES)}, not {mode!r}")
        super().__init__(sample, [], max_parallel_calls=1, **tool_env_kwargs)
        self.url = _least_busy(sample.metadata.get("openenv_url") or url)
        self.mode = mode
        self.action_field = action_field
        self.observation_field = observation_field
        self.reset_kwargs = {**(reset_kwargs or {}), **(sample.metadata.get("reset_kwargs") or {})}
        self.session = OpenEnvSession(self.url, message_timeout_s, capacity_wait_s)
        self.style = "action"

    async def reset(self) -> list[Message]:
        """Open the session, reset the env, list its tools; the prompt and the first observation."""
        seed = self.sample.metadata.get("seed", self.sample.seed)
        reset = {**({} if seed is None else {"seed": int(seed)}), "episode_id": self.instance_id[-255:]}
        first = await self.session.start({**reset, **self.reset_kwargs})
        tools = None if self.mode == "action" else await self.session.list_tools()
        if tools is None and self.mode == "tools":
            raise OpenEnvError(f"OpenEnv server {self.session.url} has no MCP tools (mode: tools)")
        if tools is not None:
            self.style = "tools"
            self._tools = select_tools([OpenEnvTool(self.session, tool) for tool in tools], self.sample)
            self.tools = [tool.schema for tool in self._tools.values()]
        prompt = list(self.sample.prompt)
        text, _ = self._observation(first.get("observation") or {})
        return [*prompt, {"role": "user", "content": text}] if text else prompt

    async def step(self, action: str) -> StepResult:
        """The tools style: the turn's tool calls as steps. The action style: the text as the action."""
        if self.style == "tools":
            result = await super().step(action)
            if self.session.broken is not None:  # a lost session is the episode's end, not a tool error
                raise self.session.broken
            return result
        reply = await self.session.step({self.action_field: action})
        if reply.get("type") == "error":  # the server's action class rejected it
            return StepResult(
                {"role": "user", "content": f"Invalid action: {_error_text(reply)}"},
                info={"invalid_actions": 1},
            )
        text, rest = self._observation(reply.get("observation") or {})
        info = {"invalid_actions": 0, "openenv_observation": rest}
        message: Message = {"role": "user", "content": text}
        return StepResult(message, float(reply.get("reward") or 0.0), bool(reply.get("done")), info)

    def format_observation(self, observation: Any) -> list[Message]:
        """Tool messages (tools style) or the one user message (action style)."""
        return list(observation) if isinstance(observation, list) else [observation]

    async def score(self, trajectory: Trajectory) -> float | None:
        """None (the sum of the step rewards), after keeping the server's ``state`` in the info."""
        try:
            state = await self.session.state()
        except OpenEnvError:
            state = {}
        trajectory.info.update({f"openenv/{k}": v for k, v in state.items() if _is_scalar(v)})
        trajectory.info["openenv/style"] = self.style
        return None

    async def close(self) -> None:
        """End the session (the server drops the episode's env)."""
        _OPEN[self.url] = max(0, _OPEN.get(self.url, 0) - 1)
        await self.session.close()

    def _observation(self, observation: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The observation's text for the model, and its other fields (for the turn's info)."""
        field = self.observation_field
        if field is None:
            texts = [k for k, v in observation.items() if isinstance(v, str)]
            field = texts[0] if len(texts) == 1 else None
        if field is None:
            return (json.dumps(observation, ensure_ascii=False) if observation else ""), {}
        if field not in observation:
            have = ", ".join(observation) or "none"
            raise OpenEnvError(f"the observation has no field {field!r} (observation_field); it has: {have}")
        rest = {k: v for k, v in observation.items() if k != field and _is_scalar(v)}
        return str(observation[field]), rest

    @staticmethod
    def dataset(size: int = 8, seed: int = 0, system_prompt: str = SYSTEM) -> list[dict[str, Any]]:
        """``size`` episodes, each with its own reset seed; the env's first observation is the task."""
        prompt = [{"role": "system", "content": system_prompt}]
        return [{"id": f"openenv/{seed}/{i}", "prompt": prompt, "seed": seed * 1000 + i} for i in range(size)]


_OPEN: dict[str, int] = {}  # sessions per server URL, open in this process


def _least_busy(urls: str | list[str]) -> str:
    """The server (of several replicas) with the fewest sessions this process has open; counted."""
    choices = [urls] if isinstance(urls, str) else list(urls)
    if not choices:
        raise ValueError("OpenEnv env: 'url' names no server")
    url = min(choices, key=lambda u: _OPEN.get(u, 0))
    _OPEN[url] = _OPEN.get(url, 0) + 1
    return url


def _is_scalar(value: Any) -> bool:
    return isinstance(value, bool | int | float | str) or value is None
