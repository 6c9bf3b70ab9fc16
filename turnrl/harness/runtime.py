"""The runtime seam of the harness: where a run's processes (the agent, and the commands its reward
runs in the run's folder) run. A ``Runtime`` turns a command into a ``Launch`` (the argv that really
starts, its variables and its limits); ``turnrl.harness.process`` starts launches and waits for them.

Three runtimes ship: ``BubblewrapRuntime`` (``turnrl.harness.sandbox``, the default),
``PodmanRuntime`` (``turnrl.harness.container``, ``env.sandbox.runtime: podman``: each command in a
container of the task's image) and ``LocalRuntime`` (``env.sandbox: none``): plain processes of the
user, each under a keeper that kills whatever the agent left behind. A remote sandbox plugs in as
another ``Runtime``: its ``launch`` gives the command that runs ``argv`` in the run's folder there,
its ``populate`` fills the folder from the place's image, and a ``Launch.close`` frees what a
command held.

A ``View`` places the run's folder and more folders at paths of the task's choosing inside the run
(a Harbor task's working directory ``/app``, its tests at ``/tests``, ``/logs/verifier``): a
sandbox or a container honours it; plain processes cannot (``LocalRuntime`` refuses one).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

KEEPER = str(Path(__file__).with_name("keeper.py"))
NO_VIEW = (
    "env.sandbox: none runs plain processes, which cannot see the run's folder at {workdir}: a task"
    " needs the bubblewrap sandbox (apt-get install bubblewrap) or a container runtime"
)


@dataclass(frozen=True)
class Bind:
    """A host folder shown inside a run at another path."""

    host: Path
    inside: str  # an absolute path
    writable: bool = False


@dataclass(frozen=True)
class View:
    """Where a run's folder appears inside it (its commands start there), and what else it sees."""

    workdir: str  # an absolute path
    binds: tuple[Bind, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # variables of the place (a Dockerfile's ENV), under the run's
    build: Path | None = None  # a Dockerfile: a container runtime runs the run in its image
    image: str | None = None  # a prebuilt image to run in (no Dockerfile)
    needs: str | None = None  # why only a container runtime can run the place (one line), or None


class Place(Protocol):
    """Where one run works, when its data row decides it (a task of ``turnrl.tasks``): its folder,
    made by ``prepare``, the view its agent sees, and how long the agent may take."""

    folder: Path

    @property
    def timeout_s(self) -> float:
        """The agent's time limit."""

    def prepare(self) -> Path:
        """Make the run's folder; returns it."""

    def view(self) -> View:
        """What the agent sees: the folder at the task's working directory, and more."""


PlaceFor = Callable[[Any, Path], "Place | None"]  # (sample, run folder) -> the run's place, None: env.folder


@dataclass
class Launch:
    """A command ready to start: what runs, with which variables, how it is limited, what to free."""

    command: list[str]  # what was asked for (the agent's own argv)
    argv: list[str]  # what starts: ``command`` wrapped by the runtime
    env: dict[str, str]
    cwd: Path
    close: Callable[[], None] = field(default=lambda: None)  # after the run: kill what is left, free
    sandboxed: bool = False
    forked: dict[str, Any] | None = None  # the sandbox a run forked in the runtime's fork server enters


class Runtime(Protocol):
    """Where a harness run's processes run."""

    name: str

    def launch(
        self,
        argv: Sequence[str],
        folder: Path,
        env: dict[str, str],
        read_only: Sequence[Path] = (),
        gateway: bool = True,
        view: View | None = None,
    ) -> Launch:
        """How to run ``argv`` in ``folder`` with ``env`` (``read_only``: files it may read;
        ``gateway``: whether it reaches the run's gateway; ``view``: ``folder`` and more at other
        paths inside, where the runtime can place them)."""

    def populate(self, folder: Path, view: View) -> None:
        """Fill the run's ``folder`` (once, before the agent starts) with what the place's image
        holds at ``view.workdir``: a container runtime's; a runtime without images does nothing."""


class LocalRuntime:
    """Plain processes of the user (``env.sandbox: none``), each under a keeper (its own session;
    a subreaper that kills every process the agent left behind when it ends)."""

    name = "none"

    def launch(
        self,
        argv: Sequence[str],
        folder: Path,
        env: dict[str, str],
        read_only: Sequence[Path] = (),
        gateway: bool = True,
        view: View | None = None,
    ) -> Launch:
        """``argv`` under the keeper, with turnrl's variables and ``env`` on top."""
        if view is not None:
            raise RuntimeError(NO_VIEW.format(workdir=view.workdir))
        return Launch(list(argv), keeper_argv(argv), {**os.environ, **env}, folder)

    def populate(self, folder: Path, view: View) -> None:
        """Nothing: plain processes have no image."""


def shown_paths(visible: Sequence[str | Path], read_only: Sequence[str]) -> set[str]:
    """The host folders a sandboxed run sees read-only at their own paths: turnrl's Python
    environment and package, ``visible`` (where the command and hooks come from) and ``read_only``
    (``env.sandbox.read_only``), those that exist, their links resolved."""
    python = {sys.prefix, sys.base_prefix, os.path.realpath(sys.executable).rsplit("/bin/", 1)[0]}
    package = str(Path(__file__).resolve().parents[1])  # turnrl itself (the keeper, the call runner)
    paths = [*python, package, *map(str, visible), *read_only]
    return {os.path.realpath(p) for p in paths if os.path.exists(p)}


def keeper_argv(argv: Sequence[str], options: Sequence[str] = ()) -> list[str]:
    """``argv`` run by the keeper (``python -I -S``: no site-packages, a fast start), with its
    ``options`` (``--bridge``, ``--cgroup``, ``--limit``: see ``turnrl.harness.keeper``)."""
    return [sys.executable, "-I", "-S", KEEPER, *options, "--", *argv]
