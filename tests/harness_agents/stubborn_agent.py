"""A test agent that misbehaves as its first argument says: ``sleep`` (a child that would outlive
it, then hangs), ``crash`` (exit 3 after a call), ``silent`` (never calls the model), ``loop``
(calls until refused)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

mode = sys.argv[1]
if mode == "sleep":  # before the SDK's import (seconds on a loaded machine), well inside the test's timeout
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(os.environ["PID_FILE"]).write_text(str(child.pid))
    time.sleep(600)
if mode == "silent":
    print("nothing to ask")
    sys.exit(0)

from openai import OpenAI  # noqa: E402

client = OpenAI(max_retries=0)
if mode == "crash":
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    print("giving up", file=sys.stderr)
    sys.exit(3)
history = [{"role": "user", "content": "count"}]
while mode == "loop":
    reply = client.chat.completions.create(model="any", messages=history, max_tokens=4)
    history += [{"role": "assistant", "content": reply.choices[0].message.content}]
    history += [{"role": "user", "content": "more"}]
