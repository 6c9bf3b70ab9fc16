"""The crash-safe JSONL writer: one record per line, flushed and fsynced before ``write`` returns."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Any

from turnrl.record.codec import json_line, trajectory_to_json
from turnrl.types import Trajectory


class JsonlWriter:
    """Appends one record per line, flushed and fsynced, so a crash loses nothing already finished."""

    def __init__(self, path: Path, fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync
        self._file: IO[str] | None = None

    def write(self, traj: Trajectory) -> None:
        """Append one trajectory, on disk when this returns."""
        self.write_record(trajectory_to_json(traj))

    def write_record(self, record: dict[str, Any]) -> None:
        """Append one JSON record as a single write."""
        line = json_line(record)
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(line)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        except OSError as exc:  # a full disk, a folder gone: say which file, keep what is written
            self._abandon()
            raise OSError(exc.errno, f"cannot write {self.path}: {exc.strerror or exc}") from exc

    def sync(self) -> None:
        """Force what is written to disk (for a writer made with ``fsync=False`` that syncs in batches)."""
        file = self._file
        if file is not None:
            with contextlib.suppress(OSError, ValueError):  # closed meanwhile: close synced it
                os.fsync(file.fileno())

    def _abandon(self) -> None:
        """Drop the file after a failed write (its buffer would fail again on close)."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None
