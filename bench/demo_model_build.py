"""The demo model's build (``turnrl demo-model``) from nothing, on an idle machine and with another
process keeping one CPU busy (a pure Python loop), as a new user's first run meets it.

    .venv/bin/python bench/demo_model_build.py [--busy-only]

Each build goes into a fresh ``TURNRL_CACHE_DIR``, so nothing is reused; the wall time includes
the demonstrations, loading SmolLM2 from its GGUF, the SFT and the save.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TURNRL = str(Path(sys.executable).with_name("turnrl"))


def build(busy: bool) -> tuple[float, int]:
    """Wall seconds of one build from nothing, and its progress lines."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TURNRL_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1"}
            t0 = time.perf_counter()
            done = subprocess.run([TURNRL, "demo-model"], env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                raise SystemExit(done.stderr[-2000:])
            said = [line for line in done.stderr.splitlines() if line.startswith("demo model:")]
            return wall, len(said)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-only", action="store_true")
    args = parser.parse_args()
    for busy in (True,) if args.busy_only else (False, True):
        wall, lines = build(busy)
        side = "one CPU busy" if busy else "idle"
        print(f"{side:>13}: {wall:6.1f} s ({wall / 60:.1f} min), {lines} progress lines", flush=True)


if __name__ == "__main__":
    main()
