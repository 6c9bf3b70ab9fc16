"""Setup and reward for ``escape_agent.py`` in tests/test_isolation.py: the setup tells a run the
other runs' session names (as a probe that found them would know them), the reward keeps what each
run found and scores 1.0 when its agent got as far as writing it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FOUND: dict[str, dict[str, Any]] = {}  # sample id -> what its agent wrote in escape.json
OPEN: list[Any] = []  # the runner under test (its gateway's open sessions)


def setup(sample: Any, folder: Path) -> None:
    own = folder.parent.name
    others = [name for runner in OPEN for name in runner.gateway.sessions if name != own]
    (folder / "targets.txt").write_text("\n".join(others))


def reward(sample: Any, result: Any) -> float:
    path = result.folder / "escape.json"
    if not path.exists():
        return 0.0
    FOUND[sample.id] = json.loads(path.read_text())
    return 1.0
