"""Progress in a log file: with stderr not a terminal, a plain line per bar every few seconds
(TURNRL_PROGRESS_SECONDS), and one at the end; a real `turnrl rollout` redirected to a file shows
its progress while it runs."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import MofNCompleteColumn, TextColumn

from turnrl.support.progress import LoggedProgress

REPO = Path(__file__).resolve().parents[1]


def test_a_log_gets_a_line_every_few_seconds_and_one_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNRL_PROGRESS_SECONDS", "0.2")
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=100)
    with LoggedProgress(TextColumn("rollout"), MofNCompleteColumn(), console=console) as bar:
        task = bar.add_task("rollout", total=4)
        for _ in range(4):
            time.sleep(0.3)
            bar.advance(task)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) >= 4 and all(line.startswith("rollout") for line in lines), lines
    assert lines[-1].split() == ["rollout", "4/4"]  # the end, as it stood
    assert "1/4" in out.getvalue() or "2/4" in out.getvalue()  # and lines while it ran


def test_a_rollout_redirected_to_a_file_shows_progress_while_it_runs(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    env = {**os.environ, "TURNRL_PROGRESS_SECONDS": "0.3", "HF_HUB_OFFLINE": "1"}
    cmd = [str(Path(sys.executable).parent / "turnrl"), "rollout", "examples/scripted_guess_number.yaml"]
    cmd += ["--set", f"output_dir={tmp_path / 'out'}", "--set", "data.kwargs.size=300"]
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=f, cwd=REPO, env=env, timeout=600)
    text = log.read_text()
    assert done.returncode == 0, text[-2000:]
    counts = [line.split()[1] for line in text.splitlines() if line.startswith("rollout") and "/300" in line]
    assert counts[-1] == "300/300", text[-2000:]
    assert any(c != "300/300" for c in counts), text[-2000:]  # lines while it ran, not only the last
