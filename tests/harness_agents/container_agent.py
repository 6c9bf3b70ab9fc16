"""A test agent for a task run in a container (``env.sandbox.runtime: podman``): one model call
through its gateway, then the task's own move with ``shout``, a tool that only the task's image
has (its Dockerfile's ``RUN`` made it). It notes in ``seen.json`` where it ran, what it saw of the
host (the file named by HOST_FILE) and whether the loopback port named by its second argument
reached anything."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from openai import OpenAI

client = OpenAI()
client.chat.completions.create(
    model=os.environ["TURNRL_MODEL"], messages=[{"role": "user", "content": sys.argv[1]}], max_tokens=4
)
words = Path("words.txt").read_text().split()
loud = [
    subprocess.run(["shout", w], capture_output=True, text=True, check=True).stdout.strip() for w in words
]
Path("out/loud.txt").write_text("\n".join(loud) + "\n")
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=2).close()
    other = "connected"
except OSError as exc:
    other = type(exc).__name__
seen = {
    "cwd": os.getcwd(),
    "files": sorted(os.listdir(".")),
    "tests": os.path.exists("/tests"),
    "solution": os.path.exists("/solution"),
    "host_file": os.path.exists(os.environ["HOST_FILE"]),
    "other_port": other,
    "system": Path("/etc/debian_version").read_text().strip(),
}
Path("seen.json").write_text(json.dumps(seen))
