"""Progress bars that also show in a log file: on a terminal, rich's live bars; on anything else
(stdout and stderr redirected to a file, a CI log, a scheduler's output), a plain line per bar every
``TURNRL_PROGRESS_SECONDS`` (30 by default), and once more at the end, rather than nothing until the
run is over."""

from __future__ import annotations

import os
import threading
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn
from rich.text import Text

EVERY_S = 30.0


def every_seconds() -> float:
    """How often a log gets a progress line (``TURNRL_PROGRESS_SECONDS``, default 30)."""
    try:
        return max(0.1, float(os.environ.get("TURNRL_PROGRESS_SECONDS", EVERY_S)))
    except ValueError:
        return EVERY_S


class LoggedProgress(Progress):
    """``rich.progress.Progress`` that prints plain lines where the console is not a terminal."""

    def __init__(self, *columns: str | ProgressColumn, console: Console, **options: Any) -> None:
        super().__init__(*columns, console=console, **options)
        self._plain = not console.is_terminal
        self._stopped = threading.Event()
        self._lines: threading.Thread | None = None

    def start(self) -> None:
        """Start the live bars, or the thread that prints a line per bar every few seconds."""
        if not self._plain:
            super().start()
            return
        if self._lines is None:
            self._stopped.clear()
            self._lines = threading.Thread(target=self._print_every, name="progress lines", daemon=True)
            self._lines.start()

    def stop(self) -> None:
        """Stop; in a log, one last line per bar."""
        if not self._plain:
            super().stop()
            return
        if self._lines is not None:
            self._stopped.set()
            self._lines.join()
            self._lines = None
            self.print_lines()

    def print_lines(self) -> None:
        """One plain line per visible bar, as the bars read now."""
        with self._lock:
            shown = [task for task in self.tasks if task.visible]
        for task in shown:  # the bars' text as one line (no bar drawn, nothing cut to 80 columns)
            parts = []
            for column in self.columns:
                if isinstance(column, BarColumn):
                    continue
                shown_as = (
                    column(task) if isinstance(column, ProgressColumn) else Text(column.format(task=task))
                )
                parts.append(shown_as.plain if isinstance(shown_as, Text) else str(shown_as))
            line = " ".join(part.strip() for part in parts if part.strip())
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _print_every(self) -> None:
        while not self._stopped.wait(every_seconds()):
            self.print_lines()
