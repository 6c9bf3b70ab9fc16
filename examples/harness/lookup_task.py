"""The key-lookup task for ``lookup_agent.py`` under ``turnrl train``: each run's folder gets the
row's codes (``setup``), and the run is scored by the answer the agent wrote (``reward``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_ANSWER = re.compile(r"<answer>\s*(\S+?)\s*</answer>")


def setup(sample: Any, folder: Path) -> None:
    """Put the row's secret codes where the agent's lookup tool reads them."""
    (folder / "codes.json").write_text(json.dumps(sample.metadata["table"]), encoding="utf-8")


def reward(sample: Any, result: Any) -> float:
    """1.0 when the agent's answer is the asked key's code, else 0.0."""
    path = result.folder / "answer.txt"
    found = _ANSWER.findall(path.read_text(encoding="utf-8")) if path.exists() else []
    return float(bool(found) and found[-1] == sample.metadata["table"][sample.metadata["key"]])
