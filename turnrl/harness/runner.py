"""One harness run per sample and group member: an isolated folder, the agent started in its
runtime (a bubblewrap sandbox by default, ``env.sandbox: none`` for plain processes) with its
session's URL and secret key, waited for within its timeout, its session's branches scored (the
reward in a thread of its own, able to run commands in the run's sandbox) and returned as
trajectories (``HarnessRunner`` is the rollout spec's ``runner``, a ``turnrl.rollout.spec.Runner``;
``turnrl.app`` builds its gateway, ``app.kinds.harness_gateway``, and hands it over).

The gateway is sealed: it serves only the sessions of runs in progress, each to its own random key,
so a run that learns another's session name still cannot call it (a 401, counted in ``/metrics``).

How a run is scored (its stop reason, the user's reward, the branches left out, each sampled token
in one branch's loss) is ``turnrl.harness.scoring``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from turnrl.config import HarnessConfig
from turnrl.gateway.server import Gateway
from turnrl.gateway.serving import GatewayServer, serve
from turnrl.harness.container import PodmanRuntime
from turnrl.harness.forkserver import ForkServer
from turnrl.harness.process import CommandResult, Exit, argv_for, run_agent, run_command
from turnrl.harness.result import HarnessResult
from turnrl.harness.runtime import LocalRuntime, Place, PlaceFor, Runtime, View
from turnrl.harness.sandbox import BubblewrapRuntime
from turnrl.harness.scoring import Scoring, as_member
from turnrl.record.episode import failed_trajectory
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.cache import cache_dir
from turnrl.support.errors import describe
from turnrl.support.imports import import_object, search_path
from turnrl.types import Sample, StopReason, Trajectory

log = logging.getLogger(__name__)
UNSANDBOXED = (
    "env.sandbox: none: agents run as your own processes, unsandboxed: what the model writes can change"
    " any file you can and reach other runs on this machine"
)


class HarnessRunner:
    """Runs the agent of ``config``, its model calls answered by ``gateway``, served on loopback."""

    def __init__(
        self, config: HarnessConfig, gateway: Gateway, out_dir: Path, places: PlaceFor | None = None
    ) -> None:
        """``gateway`` serves the runs' sessions: sealed (each answers its own key only), its engine
        the rollout's; ``out_dir`` the run's output folder (kept runs' folders go under it);
        ``places`` gives a run whose row is a task its folder, view and time limit."""
        self.config = config
        self.places = places
        self.gateway = gateway
        self.scoring = Scoring(config)
        self.setup = import_object(config.setup, "env.setup") if config.setup else None
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
            kind = PodmanRuntime if config.sandbox.runtime == "podman" else BubblewrapRuntime
            self.runtime = kind(config.sandbox, [*search_path(), *files], hidden=[out_dir, self.root])
        self._serving: asyncio.Future[GatewayServer] | None = None  # the gateway's start, shared by every run
        self._socket_dir: Path | None = None  # where the gateway's Unix socket is, for sandboxed runs
        self.forks = None
        if config.preload and not isinstance(self.runtime, PodmanRuntime):  # (preflight refuses the pair)
            # its imports see the variables every run has (env.env's fixed ones)
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
            if not isinstance(self.runtime, LocalRuntime):  # a short path: a socket's has at most 107 bytes
                self._socket_dir = Path(tempfile.mkdtemp(prefix="turnrl-gw-"))
                unix = self._socket_dir / "gateway.sock"
            self._serving = asyncio.ensure_future(self._serve(unix))
        return (await asyncio.shield(self._serving)).url

    async def _serve(self, unix: Path | None) -> GatewayServer:
        served = await serve(self.gateway, unix=unix)
        if unix is not None and isinstance(self.runtime, BubblewrapRuntime | PodmanRuntime):
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
            place = self.places(sample, run_dir) if self.places is not None else None
            self._prepare(sample, run_dir, folder, place)
            view = place.view() if place is not None else None
            if view is not None:  # a container runtime: the folder starts as the image's (a build)
                await asyncio.to_thread(self.runtime.populate, folder, view)
            inside = view.workdir if view is not None else str(folder)
            variables = self._environment(await self.url(), name, key, run_dir, inside)
            argv = argv_for(self.config.command, _prompt(sample))
            launch = self.runtime.launch(argv, folder, variables, [run_dir / "sample.json"], view=view)
            timeout = place.timeout_s if place is not None else self.config.timeout_s
            exit = await run_agent(launch, run_dir / "agent", timeout, self.forks)
            return await self._score(sample, index, name, exit, folder, run_dir)
        except Exception as exc:  # the folder or the setup hook failed: the run did not happen
            error = f"the harness run could not start: {describe(exc)}"
            return [failed_trajectory(sample, index, error, StopReason.AGENT_ERROR)]
        finally:
            self.gateway.close_session(name)
            if not self.config.keep_folders:
                shutil.rmtree(run_dir, ignore_errors=True)

    def _prepare(self, sample: Sample, run_dir: Path, folder: Path, place: Place | None) -> None:
        """The run's folder (its place's, a copy of ``env.folder``, or empty), prepared by
        ``env.setup``; the row beside it as JSON."""
        run_dir.mkdir(parents=True)
        if place is not None:
            place.prepare()
        elif self.config.folder:
            shutil.copytree(self.config.folder, folder, symlinks=True)
        else:
            folder.mkdir()
        row = asdict(sample)
        (run_dir / "sample.json").write_text(json.dumps(row, default=str), encoding="utf-8")
        if self.setup is not None:
            self.setup(sample, folder)

    def _environment(self, url: str, name: str, key: str, run_dir: Path, folder: str) -> dict[str, str]:
        """``env.env`` (``{openai_base_url}``, ``{anthropic_base_url}``, ``{api_key}``, ``{folder}``,
        ``{cache}`` filled in), and the session's URL and secret key for every client (the runtime adds the
        variables of this process a run gets: all of them unsandboxed, a few in a sandbox)."""
        fill = {
            "openai_base_url": f"{url}/s/{name}/v1",
            "anthropic_base_url": f"{url}/s/{name}",
            "api_key": key,
            "folder": folder,
            "cache": str(cache_dir()),
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
        """The run's branches as members of ``sample``'s group, scored (``scoring``)."""
        session = self.gateway.session(name)
        branches = [as_member(b.trajectory(name), sample, index) for b in session.branches]
        result = HarnessResult(
            branches, exit.code, exit.timed_out, exit.stdout, exit.stderr, folder, session.calls
        )
        result.runner = lambda argv, timeout, view: self._command(argv, folder, run_dir, timeout, view)
        return await self.scoring.score(sample, index, exit, result, session.over_budget)

    def _command(
        self, argv: list[str], folder: Path, run_dir: Path, timeout: float, view: View | None = None
    ) -> CommandResult:
        """A reward's command, run in the run's folder as the agent ran (no gateway to call)."""
        variables = {"TURNRL_SAMPLE": str(run_dir / "sample.json")}
        sample = [run_dir / "sample.json"]
        launch = self.runtime.launch(argv, folder, variables, sample, gateway=False, view=view)
        return run_command(launch, timeout)


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
