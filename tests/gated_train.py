"""`turnrl train ARGS` under torchrun, with ``vllm_helpers.PushGate`` installed in this rank: each
weight push meets turns in flight (see PushGate). Writes ``gate.rankR.json`` (how many resets the
gate released into a push) in the working folder."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import vllm_helpers

from turnrl.cli import main
from turnrl.train import overlap, weight_sync

if __name__ == "__main__":
    gate = vllm_helpers.PushGate(lead_s=float(os.environ.get("GATE_LEAD_S", "0.5")))
    vllm_helpers.GATE = gate
    overlap.learn_from = gate.wrap_learn(overlap.learn_from)  # type: ignore[assignment]
    weight_sync.servers_load = gate.wrap_load(weight_sync.servers_load)  # type: ignore[assignment]
    try:
        code = main(sys.argv[1:])
    finally:
        rank = os.environ.get("RANK", "0")
        Path(f"gate.rank{rank}.json").write_text(json.dumps({"released": gate.released}))
    sys.exit(code)
