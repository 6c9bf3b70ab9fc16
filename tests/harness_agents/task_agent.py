"""A test agent for task rows: one model call through its gateway (the task's instruction as the
prompt), then one fixed move whatever the model said: it writes ``hello.txt``, which solves the
task create-file and no other. It notes where it ran and what it saw in ``seen.json``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from openai import OpenAI

client = OpenAI()
client.chat.completions.create(
    model=os.environ["TURNRL_MODEL"], messages=[{"role": "user", "content": sys.argv[1]}], max_tokens=4
)
time.sleep(float(os.environ.get("TASK_AGENT_SLEEP", "0")))  # an agent slower than its task allows
Path("hello.txt").write_text("hello world\n")
seen = {"cwd": os.getcwd(), "files": sorted(os.listdir(".")), "tests": os.path.exists("/tests")}
seen["solution"] = os.path.exists("/solution")
Path("seen.json").write_text(json.dumps(seen))
