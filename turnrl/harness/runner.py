"""One harness run per sample and group member: an isolated folder, the agent started in its
runtime (a bubblewrap sandbox by default, ``env.sandbox: none`` for plain processes) with its
session's URL and secret key, waited for within its timeout, its session's branches scored (the
reward in a thread of its own, able to run commands in the run's sandbox) and returned as
trajectories (``HarnessRunner`` is the rollout spec's ``runner``).

The gateway is sealed: it serves only the sessions of runs in progress, each to its own random key,
so a run that learns another's session name still cannot call it (a 401, counted in ``/metrics``).

Every branch of a run carries the run's stop reason (``agent_done``; ``agent_error`` for a crash, a
non-zero exit, an agent that never called; ``agent_timeout``; ``token_budget`` when the session's
call budget ran out), its own reward, and ``run`` (``AgentRun``: exit code, time, calls, the run's
reward for the group's baseline, which is over runs, not branches). A failed run is not scored: its
branches keep reward 0 with the failure as their stop reason, and training leaves them out.
Branches not to train (``reinforce``, ``skip_system``, a reward of None) say why in ``exclude``.
Each token the run sampled is then in exactly one branch's loss, and replies the agent did not go
on from in none (``turnrl.gateway.forest``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import statistics
import tempfile
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from turnrl.chat.encoder import ChatEncoder
from turnrl.config import HarnessConfig
from turnrl.gateway.config import GatewayConfig
from turnrl.gateway.forest import train_once
from turnrl.gateway.server import Gateway
from turnrl.gateway.serving import GatewayServer, serve
from turnrl.harness.forkserver import ForkServer
from turnrl.harness.process import CommandResult, Exit, argv_for, run_agent, run_command
from turnrl.harness.result import HarnessResult, HarnessRewardFn, RewardError, branch_rewards
from turnrl.harness.runtime import LocalRuntime, Runtime
from turnrl.harness.sandbox import BubblewrapRuntime
from turnrl.rollout.episode import failed_trajectory
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.errors import describe
from turnrl.support.imports import import_object, search_path
from turnrl.tools.parser_base import ToolParser
from turnrl.tools.parsers import get_parser
from turnrl.types import AgentRun, Engine, Sample, StopReason, Trajectory

log = logging.getLogger(__name__)
UNSANDBOXED = (
    "env.sandbox: none: agents run as your own processes, unsandboxed: what the model writes can change"
    " any file you can and reach other runs on this machine"
)


class HarnessRunner:
    """Runs the agent of ``config`` against ``engine`` through a gateway it serves on loopback."""

    def __init__(
        self,
        config: HarnessConfig,
        engine: Engine,
        encoder: ChatEncoder,
        parser: ToolParser | None,
        model: str,
        out_dir: Path,
    ) -> None:
        self.config = config
        gateway_config = GatewayConfig(
            model=model,
            max_session_tokens=config.max_session_tokens,
            max_session_calls=config.max_calls,
            any_model=True,  # the agent keeps the model name it has
            output_dir=str(out_dir / "harness"),
            tool_parser=config.tool_parser,
        )
        if config.tool_parser:
            parser = get_parser(config.tool_parser)
        self.gateway = Gateway(engine, encoder, parser, gateway_config)
        self.gateway.sealed = True  # a run's session answers its own key only
        self.reward: HarnessRewardFn = import_object(config.reward, "env.reward")
        self._reward_errors: set[str] = set()  # said on the console already
        self.setup = import_object(config.setup, "env.setup") if config.setup else None
        self.skip = [re.compile(pattern) for pattern in config.skip_system]
        self.root = out_dir / "harness" if config.keep_folders else Path(tempfile.mkdtemp(prefix="turnrl-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.runtime: Runtime
        if config.sandbox == "none":
            log.warning(UNSANDBOXED)
            self.runtime = LocalRuntime()
        else:
            files = [
                Path(a).parent for a in argv_for(config.command, "") if os.sep in a and Path(a).is_file()
            ]
            self.runtime = BubblewrapRuntime(
                config.sandbox, [*search_path(), *files], hidden=[out_dir, self.root]
            )
        self._serving: asyncio.Future[GatewayServer] | None = None  # the gateway's start, shared by every run
        self._socket_dir: Path | None = None  # where the gateway's Unix socket is, for sandboxed runs
        self.forks = None
        if config.preload:  # its imports see the variables every run has (env.env's fixed ones)
            fixed = {key: value for key, value in config.env.items() if "{" not in value}
            if isinstance(self.runtime, BubblewrapRuntime):  # in a sandbox; each run enters its own
                box, root = self.runtime, self.root
                variables = box.variables(fixed)
                self.forks = ForkServer(config.preload, search_path(), variables, lambda: box.server(root))
            else:
                self.forks = ForkServer(config.preload, search_path(), {**os.environ, **fixed})

    async def url(self) -> str:
        """The gateway's base URL (started on first use: runs that ask at once share one start)."""
        if self._serving is None:
            unix = None
            if isinstance(self.runtime, BubblewrapRuntime):  # a short path: a socket's has at most 107 bytes
                self._socket_dir = Path(tempfile.mkdtemp(prefix="turnrl-gw-"))
                unix = self._socket_dir / "gateway.sock"
            self._serving = asyncio.ensure_future(self._serve(unix))
        return (await asyncio.shield(self._serving)).url

    async def _serve(self, unix: Path | None) -> GatewayServer:
        served = await serve(self.gateway, unix=unix)
        if unix is not None and isinstance(self.runtime, BubblewrapRuntime):
            self.runtime.gateway = (served.port, unix)  # sandboxed runs reach it by the socket
        return served

    async def close(self) -> None:
        """Stop the gateway and the fork server; remove the runs' folders unless they are kept."""
        if self.forks is not None:
            await self.forks.close()
        serving, self._serving = self._serving, None
        if serving is not None:
            served = await asyncio.gather(serving, return_exceptions=True)
            if isinstance(served[0], GatewayServer):
                await served[0].close()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if not self.config.keep_folders:
            shutil.rmtree(self.root, ignore_errors=True)

    async def __call__(self, sample: Sample, index: int, spec: RolloutSpec) -> list[Trajectory]:
        """Run the agent once for ``sample`` (group member ``index``): its branches, scored."""
        name = f"{_safe(sample.id)}-{index}-{uuid.uuid4().hex[:8]}"
        run_dir = self.root / name
        folder = run_dir / "work"
        key = f"turnrl-{secrets.token_urlsafe(24)}"  # the session's secret: its name is not enough
        # the spec's engine (a warm start's replay: scripted) and sampling; seeds as an env's
        # trajectory has them (the run repeats)
        self.gateway.open_session(name, key, spec.engine, spec.sampling, seed_key=f"{sample.id}/{index}")
        try:
            self._prepare(sample, run_dir, folder)
            variables = self._environment(await self.url(), name, key, run_dir, folder)
            argv = argv_for(self.config.command, _prompt(sample))
            launch = self.runtime.launch(argv, folder, variables, [run_dir / "sample.json"])
            exit = await run_agent(launch, run_dir / "agent", self.config.timeout_s, self.forks)
            return await self._score(sample, index, name, exit, folder, run_dir)
        except Exception as exc:  # the folder or the setup hook failed: the run did not happen
            error = f"the harness run could not start: {describe(exc)}"
            return [failed_trajectory(sample, index, error, StopReason.AGENT_ERROR)]
        finally:
            self.gateway.close_session(name)
            if not self.config.keep_folders:
                shutil.rmtree(run_dir, ignore_errors=True)

    def _prepare(self, sample: Sample, run_dir: Path, folder: Path) -> None:
        """The run's folder (a copy of ``env.folder``, or empty), prepared by ``env.setup``; the row
        beside it as JSON."""
        run_dir.mkdir(parents=True)
        if self.config.folder:
            shutil.copytree(self.config.folder, folder, symlinks=True)
        else:
            folder.mkdir()
        row = asdict(sample)
        (run_dir / "sample.json").write_text(json.dumps(row, default=str), encoding="utf-8")
        if self.setup is not None:
            self.setup(sample, folder)

    def _environment(self, url: str, name: str, key: str, run_dir: Path, folder: Path) -> dict[str, str]:
        """``env.env`` (``{openai_base_url}``, ``{anthropic_base_url}``, ``{api_key}``, ``{folder}``
        filled in), and the session's URL and secret key for every client (the runtime adds the
        variables of this process a run gets: all of them unsandboxed, a few in a sandbox)."""
        fill = {
            "openai_base_url": f"{url}/s/{name}/v1",
            "anthropic_base_url": f"{url}/s/{name}",
            "api_key": key,
            "folder": str(folder),
        }
        own = {k: value.format(**fill) for k, value in self.config.env.items()}
        session = {
            "OPENAI_BASE_URL": fill["openai_base_url"],
            "OPENAI_API_KEY": key,
            "ANTHROPIC_BASE_URL": fill["anthropic_base_url"],
            "ANTHROPIC_API_KEY": key,
            "TURNRL_MODEL": self.gateway.model,
            "TURNRL_SESSION": name,
            "TURNRL_SAMPLE": str(run_dir / "sample.json"),
        }
        return {**session, **own}

    async def _score(
        self, sample: Sample, index: int, name: str, exit: Exit, folder: Path, run_dir: Path
    ) -> list[Trajectory]:
        """The run's branches as trajectories, with its stop reason and rewards."""
        session = self.gateway.session(name)
        branches = [_as_member(b.trajectory(name), sample, index) for b in session.branches]
        result = HarnessResult(
            branches, exit.code, exit.timed_out, exit.stdout, exit.stderr, folder, session.calls
        )
        result.runner = lambda argv, timeout: self._command(argv, folder, run_dir, timeout)
        stop, error = _ending(exit, result, self.config.timeout_s, session.over_budget)
        if not branches:
            return [failed_trajectory(sample, index, error or "the agent never called the model", stop)]
        run = AgentRun(exit.code, round(exit.seconds, 3), session.calls)
        for traj in branches:
            traj.stop_reason, traj.error, traj.run = stop, error, run
        per_branch = False
        if stop in (StopReason.AGENT_DONE, StopReason.TOKEN_BUDGET):
            per_branch = await self._reward(sample, result, run)
        run.commands = result.commands
        self._select(branches)
        train_once(branches, credit_unchosen=per_branch)
        return branches

    def _command(self, argv: list[str], folder: Path, run_dir: Path, timeout: float) -> CommandResult:
        """A reward's command, run in the run's folder as the agent ran (no gateway to call)."""
        variables = {"TURNRL_SAMPLE": str(run_dir / "sample.json")}
        launch = self.runtime.launch(argv, folder, variables, [run_dir / "sample.json"], gateway=False)
        return run_command(launch, timeout)

    async def _reward(self, sample: Sample, result: HarnessResult, run: AgentRun) -> bool:
        """Score the branches with the user's reward, in a thread (it may run the task's tests); a
        raise or a bad value ends them as internal_error (a bug in a hook), a None leaves them out
        of training. Whether the reward scored branches one by one."""
        try:
            scores = await asyncio.to_thread(branch_rewards, self.reward, sample, result)
        except RewardError as exc:
            if str(exc) not in self._reward_errors:  # each on the console once, all in the records
                self._reward_errors.add(str(exc))
                log.warning("env.reward: %s (the run's branches end as internal_error)", exc)
            for traj in result.branches:
                traj.stop_reason, traj.error = StopReason.INTERNAL_ERROR, f"env.reward: {exc}"
            return False
        if scores is None:
            for traj in result.branches:
                traj.exclude = "reward_none"
            return False
        run.reward = statistics.fmean(scores.values)
        for traj, reward in zip(result.branches, scores.values, strict=True):
            traj.reward = reward
        return scores.per_branch

    def _select(self, branches: list[Trajectory]) -> None:
        """Mark the branches not to train: all but the last with ``reinforce: last``, and those whose
        system prompt matches ``skip_system``."""
        for i, traj in enumerate(branches):
            system = next((str(m.get("content")) for m in traj.messages if m.get("role") == "system"), "")
            last_only = self.config.reinforce == "last" and i != len(branches) - 1
            if last_only or any(p.search(system) for p in self.skip):
                traj.exclude = traj.exclude or "not_reinforced"


def _ending(
    exit: Exit, result: HarnessResult, timeout: float, over_budget: bool
) -> tuple[StopReason, str | None]:
    """The run's stop reason and error line."""
    last = (exit.stderr.strip().splitlines() or [""])[-1][-300:]
    said = f": {last}" if last else ""
    if exit.error is not None:
        return StopReason.AGENT_ERROR, exit.error
    if exit.timed_out:
        killed = f"the agent ran past env.timeout_s {timeout:g} s and was killed{said}"
        return StopReason.AGENT_TIMEOUT, killed
    if over_budget:
        return StopReason.TOKEN_BUDGET, f"the agent made {result.calls} calls, its limit (env.max_calls)"
    if not result.branches:
        return StopReason.AGENT_ERROR, f"the agent never called the model (exit code {exit.code}){said}"
    if exit.code != 0:
        return StopReason.AGENT_ERROR, f"the agent exited with code {exit.code}{said}"
    return StopReason.AGENT_DONE, None


def _as_member(traj: Trajectory, sample: Sample, index: int) -> Trajectory:
    """A branch as member ``index`` of ``sample``'s group (its id names the branch)."""
    branch = traj.branch.index if traj.branch else 0
    traj.id = f"{sample.id}/{index}" + (f"/{branch}" if branch else "")
    traj.group_id, traj.sample_index, traj.data_source = sample.id, index, sample.data_source
    return traj


def _prompt(sample: Sample) -> str:
    """The row's last user message, as text."""
    user = [m for m in sample.prompt if m.get("role") == "user"]
    content: Any = user[-1].get("content", "") if user else ""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _safe(text: str) -> str:
    """``text`` as a URL path segment (letters, digits, ``._-``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:64] or "run"
