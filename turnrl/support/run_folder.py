"""One writer per run folder: an OS lock held for the run's life, and a replaced run kept aside
until its replacement has something to show.

The lock is ``flock`` on ``FOLDER/.turnrl.lock`` (which holds the holder's PID): the OS drops it
when the process ends, however it ends, so a crashed run never leaves a stale lock. A process
keeps the locks it takes until it exits or calls ``release``; taking one it already holds is a
no-op, so the command line and the run it starts can both claim the same folder.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

LOCK_FILE = ".turnrl.lock"
REPLACED = ".replaced"  # the run an --overwrite replaces, until the new one has a good trajectory
FAILED = "failed"  # where a replacement that produced nothing usable is kept, the old run put back

_held: dict[Path, int] = {}  # folder (resolved) -> the open lock file's descriptor
_made: dict[Path, list[Path]] = {}  # folder (resolved) -> the folders its lock made, deepest first


class RunFolderBusy(ValueError):
    """Another live process writes this run folder."""


def _key(folder: Path) -> Path:
    return folder.resolve()


def try_lock(folder: Path) -> bool:
    """Take ``folder``'s lock (making the folder); False when another process holds it."""
    key = _key(folder)
    if key in _held:
        return True
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            same = os.stat(folder / LOCK_FILE).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file as it left: lock the one at the path now
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = fd
    _made[key] = made
    return True


@atexit.register
def _leave_no_empty_folders() -> None:
    """At exit, a folder this process locked but wrote nothing into (a run refused on bad input)
    is removed with the parents it made: bad input leaves no trace."""
    for key, fd in list(_held.items()):
        with contextlib.suppress(OSError):
            if [p.name for p in key.iterdir()] == [LOCK_FILE]:
                (key / LOCK_FILE).unlink()
                for folder in _made.get(key, [key]):
                    folder.rmdir()
        os.close(fd)
    _held.clear()


def holder(folder: Path) -> str:
    """The PID written by the process that holds ``folder``'s lock ('?' when unreadable)."""
    try:
        return (folder / LOCK_FILE).read_text().strip() or "?"
    except OSError:
        return "?"


def release(folder: Path) -> None:
    """Give ``folder``'s lock back (kept otherwise until the process ends)."""
    _made.pop(_key(folder), None)
    fd = _held.pop(_key(folder), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor drops the flock


def _cannot_write(folder: Path, exc: OSError) -> RunFolderBusy:
    return RunFolderBusy(f"cannot write to the output folder {folder}: {exc.strerror or exc}")


def claim(folder: Path) -> None:
    """Lock ``folder`` for this process, or refuse naming the process that writes it."""
    try:
        locked = try_lock(folder)
    except OSError as exc:
        raise _cannot_write(folder, exc) from None
    if not locked:
        raise RunFolderBusy(
            f"{folder} is being written by another turnrl run (PID {holder(folder)}): wait for it to end, "
            "or set output_dir"
        )


def claim_free(out: Path, holds_run: Callable[[Path], bool]) -> Path:
    """The first of ``out``, ``out-2``, ``out-3``... that holds no run and that no other process
    writes, locked for this process: two launches of one command never share a folder."""
    n = 1
    while True:
        folder = out if n == 1 else out.with_name(f"{out.name}-{n}")
        try:
            if try_lock(folder):
                if not holds_run(folder):
                    return folder
                release(folder)
        except OSError as exc:
            raise _cannot_write(folder, exc) from None
        n += 1


def set_aside(out: Path, names: Iterable[str]) -> bool:
    """Move the named outputs of the run in ``out`` into ``out/.replaced`` (an --overwrite keeps the
    old run until the new one has a good trajectory); whether there was anything to move."""
    present = [n for n in names if (out / n).exists()]
    if not present:
        return False
    aside = out / REPLACED
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    for name in present:
        os.replace(out / name, aside / name)
    return True


def drop_aside(out: Path) -> None:
    """Delete the replaced run for good."""
    shutil.rmtree(out / REPLACED, ignore_errors=True)


def put_back(out: Path, names: Iterable[str]) -> bool:
    """The new run produced nothing usable: move what it wrote into ``out/failed`` and put the
    replaced run back; whether there was a replaced run."""
    aside = out / REPLACED
    if not aside.is_dir():
        return False
    failed = out / FAILED
    shutil.rmtree(failed, ignore_errors=True)
    for name in names:
        if (out / name).exists():
            failed.mkdir(exist_ok=True)
            os.replace(out / name, failed / name)
    for item in aside.iterdir():
        os.replace(item, out / item.name)
    with contextlib.suppress(OSError):
        aside.rmdir()
    return True
