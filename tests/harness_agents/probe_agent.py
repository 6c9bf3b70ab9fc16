"""A test agent that writes what it sees of its own process to the file PROBE_FILE names (working
folder, argv, sys.path[0], a variable, stdin, whether it leads its process group, its capabilities,
the processes it sees, its limits), prints a line to
stdout and one to stderr, and makes one model call."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

from openai import OpenAI

seen = {
    "cwd": os.getcwd(),
    "argv": sys.argv,
    "path0": sys.path[0],
    "var": os.environ.get("PROBE_VAR"),
    "stdin": sys.stdin.read(),
    "leader": os.getpgid(0) == os.getpid() == os.getsid(0),
    "main": __name__,
    "capabilities": [line for line in Path("/proc/self/status").read_text().splitlines() if "Cap" in line],
    "processes": len([pid for pid in os.listdir("/proc") if pid.isdigit()]),
    "limits": [resource.getrlimit(getattr(resource, f"RLIMIT_{name}")) for name in ("DATA", "FSIZE", "CORE")],
    "home": os.environ.get("HOME"),
    "tmp": sorted(os.listdir("/tmp")),
}
Path(os.environ["PROBE_FILE"]).write_text(json.dumps(seen), encoding="utf-8")
print("to stdout")
print("to stderr", file=sys.stderr)
OpenAI(max_retries=0).chat.completions.create(
    model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4
)
