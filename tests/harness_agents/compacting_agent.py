"""A test agent on the plain openai SDK: two calls, then it compacts its history into a summary and
calls once more (a rewrite: the gateway must start a second branch)."""

from __future__ import annotations

import sys

from openai import OpenAI

client = OpenAI()
history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": sys.argv[1]}]
for _ in range(2):
    reply = client.chat.completions.create(model="any", messages=history, max_tokens=8)
    history += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
    history += [{"role": "user", "content": "Go on."}]
summary = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Summary: done twice."},
]
client.chat.completions.create(model="any", messages=summary, max_tokens=8)
