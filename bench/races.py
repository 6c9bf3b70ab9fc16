"""Two real `turnrl rollout` processes racing for one run folder, at gaps of 0-10 s.

For each gap: the same command is launched twice, the second ``gap`` seconds after the first
(``fresh``); then two ``--resume`` of one half-done run at once (``resume``). Each run is 8
prompts x 2 samples of an env whose steps take a second, on the scripted engine (the real
tokenizer and template, no model), so a run lasts a few seconds and the gaps fall before, during
and after the first run's folder exists. Counted: the folders written, the records in each, the
trajectories lost (expected - distinct) and duplicated (records - distinct), the exit codes.

    .venv/bin/python bench/races.py [--gaps 0 0.5 1 2 3 5 8 10]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ENVS = """
import asyncio
from turnrl import Env, StepResult


class Slow(Env):
    async def step(self, action):
        await asyncio.sleep(1.0)
        return StepResult("more", reward=1.0, done=False)


def rows(size=8):
    return [{"id": f"r{i}", "prompt": "Say hi."} for i in range(size)]


def policy(messages, images, sample):
    return "hi"
"""
EXPECTED = 16


def write_config(folder: Path, model: str) -> Path:
    (folder / "race_envs.py").write_text(ENVS)
    config: dict[str, Any] = {
        "model": model,
        "engine": {"kind": "scripted", "policy": "race_envs:policy"},
        "env": {"name": "race_envs:Slow"},
        "data": {"generator": "race_envs:rows"},
        "sampling": {"max_tokens": 8},
        "limits": {"max_turns": 2, "max_context_tokens": 512},
        "rollout": {"group_size": 2, "concurrency": 4},
        "output_dir": str(folder / "run"),
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(config: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "turnrl.cli", "rollout", str(config), *args]
    quiet = subprocess.DEVNULL  # unread pipes could fill and stall a run
    return subprocess.Popen(command, cwd=config.parent, stdout=quiet, stderr=quiet, text=True)


def count(folder: Path) -> tuple[int, int]:
    """(records, distinct trajectories) in a run folder."""
    path = folder / "trajectories.jsonl"
    if not path.exists():
        return 0, 0
    keys = [(r["group_id"], r["sample_index"]) for r in map(json.loads, path.read_text().splitlines())]
    return len(keys), len(set(keys))


def fresh(root: Path, model: str, gap: float) -> dict[str, Any]:
    config = write_config(root, model)
    first = launch(config)
    time.sleep(gap)
    second = launch(config)
    codes = [p.wait(timeout=600) for p in (first, second)]
    folders = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("run"))
    counts = [count(f) for f in folders]
    records, distinct = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return {
        "race": f"fresh, gap {gap:g} s",
        "exit codes": codes,
        "folders": ", ".join(f"{f.name} ({c[0]})" for f, c in zip(folders, counts, strict=True)),
        "lost": 2 * EXPECTED - distinct,
        "duplicated": records - distinct,
    }


def resume(root: Path, model: str, gap: float) -> dict[str, Any]:
    config = write_config(root, model)
    first = launch(config)
    out = root / "run" / "trajectories.jsonl"
    while first.poll() is None and not (out.exists() and out.read_text().count("\n") >= 4):
        time.sleep(0.1)
    first.kill()  # kill -9 a run half done
    first.wait()
    a = launch(config, "--resume")
    time.sleep(gap)
    b = launch(config, "--resume")
    codes = [p.wait(timeout=600) for p in (a, b)]
    records, distinct = count(root / "run")
    return {
        "race": f"two --resume, gap {gap:g} s",
        "exit codes": codes,
        "folders": f"run ({records})",
        "lost": EXPECTED - distinct,
        "duplicated": records - distinct,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gaps", type=float, nargs="*", default=[0, 0.5, 1, 2, 3, 5, 8, 10])
    parser.add_argument("--resume-gaps", type=float, nargs="*", default=[0, 1])
    args = parser.parse_args()
    from turnrl.models import resolve_model

    model = resolve_model("tiny-qwen3").path
    rows = []
    for kind, gaps in ((fresh, args.gaps), (resume, args.resume_gaps)):
        for gap in gaps:
            root = Path(tempfile.mkdtemp(prefix="turnrl-race-"))
            try:
                rows.append(kind(root, model, gap))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(rows[-1], file=sys.stderr, flush=True)
    print("| race | exit codes | folders (records) | lost | duplicated |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['race']} | {r['exit codes']} | {r['folders']} | {r['lost']} | {r['duplicated']} |")
    bad = sum(r["lost"] + r["duplicated"] for r in rows)
    print(f"\n{len(rows)} races: {bad} trajectories lost or duplicated in all")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
