"""Checks a run makes before its first trajectory, so that a mistake is one line and exit 2 at once
rather than every trajectory failing: the prompts, the env (built once), the chat template.

A mistake these miss still stops the run early: more than ``rollout.fail_fraction`` of the
trajectories failing is ``RunFailed`` (``turnrl.rollout.failures``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

from turnrl.app.parts import EnvRouter, RunError
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import HarnessConfig
from turnrl.env.base import Env, EnvFactory
from turnrl.support.errors import describe
from turnrl.support.imports import import_object
from turnrl.types import Sample


def check_prompts(samples: Sequence[Sample]) -> None:
    """Every prompt message has a role and a content (or tool calls)."""
    for sample in samples:
        for i, message in enumerate(sample.prompt):
            if not isinstance(message, dict) or "role" not in message:
                raise RunError(f"data row {sample.id!r}: prompt message {i} has no 'role'")
            if "content" not in message and not message.get("tool_calls"):
                raise RunError(f"data row {sample.id!r}: prompt message {i} has no 'content'")


def check_env(name: str, factory: EnvFactory, first: Sample) -> None:
    """Build the env of the first row once (in this process): it must build, and be an ``Env``.
    This is where a misspelt tool parser, a missing tool or a sandbox without bubblewrap shows."""
    if not isinstance(factory, EnvRouter):  # envs in Ray workers are built there
        return
    try:
        env = factory(first)
    except Exception as exc:
        raise RunError(f"env {name!r} cannot be built: {describe(exc)}") from None
    if not isinstance(env, Env):
        raise RunError(
            f"env {name!r} made a {type(env).__name__}, not a turnrl Env: subclass turnrl.Env "
            "(docs/environments.md)"
        )
    _close_soon(env)


_closing: set[asyncio.Task[None]] = set()  # closes in flight (a task nobody holds may vanish)


def _close_soon(env: Env) -> None:
    """Close the env built for the check (now, or on the running loop)."""
    with contextlib.suppress(Exception):
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(_closed(env, 10.0))
        else:
            task = loop.create_task(env.close())
            _closing.add(task)
            task.add_done_callback(_closing.discard)


async def _closed(env: Env, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        await env.close()


def check_template(encoder: ChatEncoder, first: Sample) -> None:
    """The chat template renders the first row's prompt, to at least one token."""
    if not first.prompt:
        return  # the env's reset makes the prompt
    try:
        ids = encoder.conversation().prompt(list(first.prompt)).ids
    except Exception as exc:
        raise RunError(f"the chat template cannot render the first prompt: {describe(exc)}") from None
    if not ids:
        raise RunError("the chat template renders the first prompt as no tokens at all: check chat.template")


def check_run(name: str, samples: Sequence[Sample], factory: EnvFactory) -> None:
    """``check_prompts`` and ``check_env``, before any model loads."""
    if not samples:
        raise RunError("no data: the data has no rows")
    check_prompts(samples)
    check_env(name, factory, samples[0])


def check_harness(env: HarnessConfig, samples: Sequence[Sample]) -> None:
    """An agent harness's inputs: the prompts, the sandbox, that its command and hooks exist."""
    if not samples:
        raise RunError("no data: the data has no rows")
    check_prompts(samples)
    from turnrl.harness.process import check_command, check_preload

    problem = _sandbox_problem(env) or check_command(env.command) or check_preload(env.preload)
    if problem:
        raise RunError(problem)
    for hook, what in ((env.reward, "env.reward"), (env.setup, "env.setup")):
        if hook:
            import_object(hook, what)
    if env.folder and not Path(env.folder).is_dir():
        raise RunError(f"env.folder {env.folder!r} is not a folder")
    tasks = [s for s in samples if isinstance(s.metadata, dict) and s.metadata.get("task")]
    if tasks and env.sandbox == "none":  # plain processes cannot see the folder at the task's path
        why = "runs at its own path (/app) in a sandbox: drop env.sandbox: none"
        raise RunError(f"row {tasks[0].id} is a task, which {why}")
    if tasks and env.sandbox != "none" and env.sandbox.runtime != "podman":
        from turnrl.tasks.harness import task_of

        for sample in tasks:  # one that needs a container is refused before any run starts
            task = task_of(sample)
            if task is not None and task.needs_container:
                raise RunError(f"{task.needs_container}: set env.sandbox.runtime: podman")


def _sandbox_problem(env: HarnessConfig) -> str | None:
    """Why ``env.sandbox`` cannot run here (one line), or None."""
    from turnrl.harness.sandbox import bwrap_missing

    if env.sandbox == "none":
        return None
    if env.sandbox.runtime != "podman":
        return bwrap_missing()
    from turnrl.harness.container import podman_missing

    if env.preload:
        return "env.preload forks runs in the bubblewrap sandbox: drop it with env.sandbox.runtime: podman"
    return podman_missing(env.sandbox)
