"""Start and stop the example OpenEnv servers (examples/openenv_server.py) for the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from turnrl.engines.process import free_port, port_in_use

SERVER = Path(__file__).resolve().parents[1] / "examples" / "openenv_server.py"


def serve(kind: str, max_sessions: int = 64) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "OPENENV_MAX_SESSIONS": str(max_sessions)}
    proc = subprocess.Popen([sys.executable, str(SERVER), kind, str(port)], env=env)
    deadline = time.monotonic() + 60
    while not port_in_use(port):
        assert proc.poll() is None and time.monotonic() < deadline, f"the OpenEnv {kind} server did not start"
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=10)
