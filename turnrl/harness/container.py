"""A container runtime for harness runs (``env.sandbox.runtime: podman``): each of a run's commands
(the agent, the task's tests, ``check-tasks``' solution) in a new container of the run's image, the
run's folder bound at the task's working directory.

The image: a task's whole ``environment/Dockerfile`` built by ``podman build`` (``RUN`` steps that
install packages included; cached by a digest of its folder), its prebuilt ``docker_image``, or
``env.sandbox.image`` for a row that is no task. Before the agent starts, ``populate`` copies what
the image holds at the working directory into the run's folder (``podman create`` + ``podman cp``):
the folder is the run's state, so the agent's files are what the tests see; what a command writes
elsewhere in its container is gone when it ends, as a fresh container is each command's.

What a command sees: the image, the run's folder read-write, the place's binds (``/logs``, and the
tests or the solution for those commands only), turnrl's Python environment and ``read_only`` paths
read-only at their own paths (the image's system stays the image's: an agent that runs from turnrl's
environment needs the same Python in the image, as a Debian image has), and nothing else of the
host. The network: "gateway" runs ``podman run --network host`` inside a network namespace of its
own (bubblewrap's ``--unshare-net``) where the run's keeper bridges the gateway's port to its Unix
socket, so the container's loopback reaches its gateway and nothing else; a command that calls no
gateway gets ``--network none``. Limits: ``--pids-limit``, ``--memory``, file size and no core
files. A command's container is removed when it ends (``podman rm -f``), by its timeout too.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from turnrl.config import SandboxConfig
from turnrl.harness.runtime import Launch, View, keeper_argv, shown_paths
from turnrl.tools.sandbox import SYSTEM_DIRS

BUILD_TIMEOUT_S = 3600.0  # a build that installs packages may take long; this bounds it
PODMAN_TIMEOUT_S = 120.0  # create, cp, rm
COVERS = frozenset({"/", "/tmp", *SYSTEM_DIRS})  # never bound whole: the image's own


ROOTLESS = (
    "env.sandbox.runtime podman as a user other than root: rootless podman cannot start inside the"
    " network namespace that bridges the gateway (a user namespace in a user namespace); run turnrl as"
    " root, or set env.sandbox.network: host (the machine's network)"
)


def podman_missing(config: SandboxConfig, agents: bool = True) -> str | None:
    """Why ``config``'s podman runtime cannot run here (one line), or None (``agents``: it also
    runs agents, which reach their gateway through a bridge)."""
    if shutil.which(config.podman[0]) is None:
        return f"env.sandbox.runtime podman: {config.podman[0]} is not installed (apt-get install podman)"
    if agents and config.network == "gateway" and os.geteuid() != 0:
        return ROOTLESS
    if config.network == "gateway" and shutil.which("bwrap") is None:
        return (
            "env.sandbox.runtime podman: its gateway network is a bubblewrap network namespace"
            " (apt-get install bubblewrap), or set env.sandbox.network: host"
        )
    return None


class PodmanRuntime:
    """Runs a harness run's commands in podman containers (see the module doc)."""

    name = "podman"

    def __init__(
        self,
        config: SandboxConfig,
        visible: Sequence[str | Path] = (),
        hidden: Sequence[str | Path] = (),
        gateway: tuple[int, Path] | None = None,
    ) -> None:
        missing = podman_missing(config, agents=False)
        if missing:
            raise RuntimeError(missing)
        self.config = config
        self.podman = [shutil.which(config.podman[0]) or config.podman[0], *config.podman[1:]]
        self.visible = sorted(shown_paths(visible, config.read_only) - COVERS, key=len)  # not the image's own
        self.hidden = [str(Path(p).resolve()) for p in hidden]
        self.gateway = gateway  # the port agents call, and the gateway's Unix socket
        self._images: dict[str, str] = {}  # a Dockerfile's path: its image's tag
        self._lock = threading.Lock()

    def image(self, view: View | None) -> str:
        """The image a run with ``view`` runs in (a task's built on first use)."""
        if view is not None and view.build is not None:
            return self._build(view.build)
        if view is not None and view.image:
            return view.image
        if self.config.image:
            return self.config.image
        raise RuntimeError(
            "env.sandbox.runtime podman: this row names no task with an image: set env.sandbox.image"
        )

    def populate(self, folder: Path, view: View) -> None:
        """The image's files at ``view.workdir`` copied into ``folder`` (a task's image only: the
        folder of a run in ``env.sandbox.image`` is its place's or ``env.folder``'s)."""
        if view.build is None and not view.image:
            return
        image = self.image(view)
        name = f"turnrl-seed-{uuid.uuid4().hex[:12]}"
        self._podman(["create", "--name", name, image, "true"], f"podman create of {image}")
        try:
            done = self._podman(["cp", f"{name}:{view.workdir}/.", str(folder)], None)
            if done.returncode != 0 and "no such file" not in done.stderr.lower():
                raise RuntimeError(f"podman cp of {image}:{view.workdir}: {_last(done.stderr)}")
        finally:
            self._podman(["rm", "-f", name], None)

    def launch(
        self,
        argv: Sequence[str],
        folder: Path,
        env: dict[str, str],
        read_only: Sequence[Path] = (),
        gateway: bool = True,
        view: View | None = None,
    ) -> Launch:
        """``argv`` in a new container of the run's image, ``folder`` at its working directory
        (``gateway``: its loopback bridged to the run's gateway)."""
        image = self.image(view)
        name = f"turnrl-{uuid.uuid4().hex[:12]}"
        bridge = self.gateway if gateway and self.config.network == "gateway" else None
        # host: the machine's, or with a bridge the network namespace it listens in
        network = "host" if self.config.network == "host" or bridge is not None else "none"
        variables = {**dict(view.env if view is not None else ()), **env}
        cmd = [*self.podman, "run", "--rm", "--name", name, "--network", network]
        cmd += self._limits() + self._mounts(folder, read_only, view)
        for key in variables:  # by name: the values are podman's own variables, not its argv
            cmd += ["--env", key]
        cmd += [image, *argv]
        close = _remover([*self.podman, "rm", "-f", "-t", "0", name])
        if bridge is None:  # no agent, or the machine's network
            return Launch(list(argv), keeper_argv(cmd), {**os.environ, **variables}, folder, close, True)
        if os.geteuid() != 0:
            raise RuntimeError(ROOTLESS)
        netns = [
            shutil.which("bwrap") or "bwrap",
            "--dev-bind",
            "/",
            "/",
            "--unshare-net",
            "--die-with-parent",
        ]
        wrapped = [*netns, "--", *keeper_argv(cmd, ["--bridge", str(bridge[0]), str(bridge[1])])]
        return Launch(list(argv), wrapped, {**os.environ, **variables}, folder, close, True)

    def _limits(self) -> list[str]:
        mib = 1 << 20
        fsize = self.config.file_size_mb * mib
        return [
            "--pids-limit",
            str(self.config.max_processes),
            "--memory",
            f"{self.config.memory_mb}m",
            "--ulimit",
            f"fsize={fsize}:{fsize}",
            "--ulimit",
            "core=0:0",
        ]

    def _mounts(self, folder: Path, read_only: Sequence[Path], view: View | None) -> list[str]:
        """The run's folder at its working directory, the place's binds, turnrl's environment and
        the read-only paths; the hidden folders covered where a visible one holds them."""
        workdir = view.workdir if view is not None else str(folder)
        cmd = ["--volume", f"{folder}:{workdir}:rw", "--workdir", workdir]
        for bind in view.binds if view is not None else ():
            cmd += ["--volume", f"{bind.host}:{bind.inside}:{'rw' if bind.writable else 'ro'}"]
        for path in (*self.visible, *map(str, read_only)):
            cmd += ["--volume", f"{path}:{path}:ro"]
        for path in self.hidden:
            if any(path.startswith(v + "/") or path == v for v in self.visible):
                cmd += ["--tmpfs", path]
        return cmd

    def _build(self, dockerfile: Path) -> str:
        """The image of ``dockerfile`` (its folder the build context), built once per content (the
        folder is read once a runtime: a task does not change during a run)."""
        context = dockerfile.parent
        with self._lock:
            if str(dockerfile) in self._images:
                return self._images[str(dockerfile)]
            digest = _digest(context)
            task = re.sub(r"[^a-z0-9._-]", "-", context.parent.name.lower())[:60] or "task"
            tag = f"localhost/turnrl-task-{task}:{digest[:16]}"
            if self._podman(["image", "exists", tag], None).returncode != 0:
                # the machine's network for RUN steps (the task author's, as docker build's): a rootless
                # podman's default (slirp4netns) needs /dev/net/tun, which some machines withhold
                args = ["build", "--quiet", "--network", "host", "--tag", tag, "--file", str(dockerfile)]
                args.append(str(context))
                self._podman(args, f"podman build of {dockerfile}", BUILD_TIMEOUT_S)
            self._images[str(dockerfile)] = tag
            return tag

    def _podman(
        self, args: list[str], what: str | None, timeout: float = PODMAN_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """``podman args``; when ``what`` names it, a failure raises one line saying so."""
        try:
            done = subprocess.run(
                [*self.podman, *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what or 'podman ' + args[0]}: still running after {timeout:g} s") from None
        if what is not None and done.returncode != 0:
            raise RuntimeError(f"{what} failed: {_last(done.stderr)}")
        return done


def _digest(context: Path) -> str:
    """A digest of every file under ``context`` (names and bytes)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(context)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _last(text: str) -> str:
    """The last line of a command's stderr that says something."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _remover(argv: list[str]) -> Callable[[], None]:
    """What removes a command's container when it ended (or was killed)."""

    def remove() -> None:
        subprocess.run(argv, capture_output=True, timeout=PODMAN_TIMEOUT_S, stdin=subprocess.DEVNULL)

    return remove
