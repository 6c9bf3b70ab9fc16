"""A test agent that writes what it sees of its own process to the file PROBE_FILE names (working
folder, argv, sys.path[0], a variable, stdin, whether it leads its process group), prints a line to
stdout and one to stderr, and makes one model call."""

from __future__ import annotations

import json
import os
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
}
Path(os.environ["PROBE_FILE"]).write_text(json.dumps(seen), encoding="utf-8")
print("to stdout")
print("to stderr", file=sys.stderr)
OpenAI(max_retries=0).chat.completions.create(
    model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4
)
