"""The part of a task's ``environment/Dockerfile`` that runs on the local sandbox: a base image
(``FROM``), a working directory (``WORKDIR``), files copied from the build context into it
(``COPY``/``ADD`` of local files) and variables (``ENV``, ``ARG`` with a default). Anything more
(``RUN`` steps that install packages, a copy out of another stage, a download, a copy outside the
working directory) needs a container runtime: ``Dockerfile.read`` says so in one line (``needs``), and a task
that needs one is refused on the local sandbox, so that no task runs half set up. The base image
itself is not there: the sandbox shows this machine's system folders instead (its bash, python and
coreutils). A container runtime (``turnrl.harness.container``) builds the whole Dockerfile
instead, and takes only the final working directory from here."""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_WORKDIR = "/app"  # a Dockerfile without WORKDIR: Harbor's tasks work in /app
NEEDS_CONTAINER = "needs a container runtime (the local sandbox runs FROM, WORKDIR, COPY, ENV and ARG only)"
IGNORED = {"LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "SHELL", "STOPSIGNAL", "HEALTHCHECK"}
IGNORED |= {"USER", "VOLUME", "ONBUILD"}  # the run is the user's own, in a folder of its own


class TaskError(ValueError):
    """A task folder that cannot run here: one line naming the task and what it needs."""


@dataclass(frozen=True)
class Copy:
    """A file or folder of the build context copied to a path under the working directory."""

    source: Path
    dest: str  # relative to the working directory ("" or "." for the folder itself)


@dataclass(frozen=True)
class Dockerfile:
    """What the local sandbox takes from a Dockerfile."""

    base: str | None = None
    workdir: str = DEFAULT_WORKDIR
    copies: tuple[Copy, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    needs: str | None = None  # the first thing only a container runtime does (one line), or None

    @classmethod
    def read(cls, path: Path, task: str) -> Dockerfile:
        """``path`` parsed (its build context is its folder): what the local sandbox takes, and in
        ``needs`` the first thing it cannot do (naming ``task``, the line and what it needs);
        ``TaskError`` for a copy of a file the context does not have."""
        context = path.parent
        base: str | None = None
        needs: list[str] = []
        workdir, copies, env = DEFAULT_WORKDIR, list[Copy](), dict[str, str]()
        pending: list[tuple[int, list[str], str]] = []  # copies resolved once the WORKDIR is final
        for number, line in _instructions(path.read_text(encoding="utf-8")):
            word, _, rest = line.partition(" ")
            word, rest = word.upper(), rest.strip()
            where = f"task {task}: {path.name} line {number}"
            if word == "FROM":
                if base is not None:  # the final stage is what runs: its working directory counts
                    needs.append(f"{where}: a second FROM (a multi-stage build) {NEEDS_CONTAINER}")
                    workdir, pending = DEFAULT_WORKDIR, []
                base = rest.split()[0] if rest else None
            elif word == "WORKDIR":
                workdir = posixpath.normpath(posixpath.join(workdir, _expand(rest, env)))
            elif word in ("ENV", "ARG"):
                env.update(_assignments(rest, env, default_only=word == "ARG"))
            elif word in ("COPY", "ADD"):
                args = [
                    a
                    for a in shlex.split(rest)
                    if not a.startswith("--chown") and not a.startswith("--chmod")
                ]
                if any(a.startswith("--") for a in args):
                    needs.append(f"{where}: {word} {args[0]} {NEEDS_CONTAINER}")
                elif word == "ADD" and any(re.match(r"^[a-z]+://", a) for a in args):
                    needs.append(f"{where}: ADD of a URL downloads at build time and {NEEDS_CONTAINER}")
                else:
                    pending.append((number, [_expand(a, env) for a in args], workdir))
            elif word not in IGNORED:
                needs.append(f"{where}: {word} {NEEDS_CONTAINER}")
        for number, args, at in pending:
            where = f"task {task}: {path.name} line {number}"
            outside = _outside(args, at, workdir, where)
            if outside:
                needs.append(outside)
            else:
                copies += _copies(args, at, workdir, context, where)
        return cls(base, workdir, tuple(copies), env, needs[0] if needs else None)


def _instructions(text: str) -> list[tuple[int, str]]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped, with the number
    of the line each starts on."""
    found: list[tuple[int, str]] = []
    current, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if not current:
            start = number
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        found.append((start, current.strip()))
        current = ""
    if current:
        found.append((start, current.strip()))
    return found


def _expand(text: str, env: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced by what ENV and ARG set (unknown names: empty)."""
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), ""), text)


def _assignments(rest: str, env: dict[str, str], default_only: bool) -> dict[str, str]:
    """``ENV A=1 B=2``, ``ENV A 1`` (the old form) or ``ARG A=1`` (an ARG without a default sets
    nothing)."""
    words = shlex.split(rest)
    if not default_only and words and "=" not in words[0]:
        return {words[0]: _expand(" ".join(words[1:]), env)}
    found = {}
    for word in words:
        name, eq, value = word.partition("=")
        if eq:
            found[name] = _expand(value, env)
    return found


def _outside(args: list[str], at: str, workdir: str, where: str) -> str | None:
    """Why ``COPY SRC... DEST`` needs a container (its destination is outside the working
    directory, where only the run's folder is the task's), or None."""
    if len(args) < 2:
        return None
    target = posixpath.normpath(posixpath.join(at, args[-1]))
    inside = posixpath.relpath(target, workdir)
    if inside == ".." or inside.startswith("../"):
        return f"{where}: COPY to {target}, outside the working directory {workdir}, {NEEDS_CONTAINER}"
    return None


def _copies(args: list[str], at: str, workdir: str, context: Path, where: str) -> list[Copy]:
    """``COPY SRC... DEST`` as copies under the final working directory."""
    if len(args) < 2:
        raise TaskError(f"{where}: COPY needs a source and a destination")
    *sources, dest = args
    inside = posixpath.relpath(posixpath.normpath(posixpath.join(at, dest)), workdir)
    copies = []
    for source in sources:
        path = (context / source).resolve()
        if not path.is_relative_to(context.resolve()) or not path.exists():
            raise TaskError(f"{where}: COPY {source}: no such file in the task's environment/ folder")
        into = dest.endswith("/") or len(sources) > 1 or (path.is_file() and inside == ".")
        copies.append(Copy(path, posixpath.join(inside, path.name) if into and path.is_file() else inside))
    return copies
