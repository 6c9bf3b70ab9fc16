"""A test agent that tries one escape (its first argument), writes what it found to
``escape.json`` in its folder, then makes one model call and exits 0 (or stays, for the modes that
leave processes behind or hang). Each mode is one thing a model could write:

- ``write``: files in the host paths ESCAPE_PATHS names (``:``-separated), ``..``, ``$HOME``, /tmp
- ``environ``: every other process's variables (``/proc/*/environ``): session names and keys
- ``call``: another run's session (its name in ``targets.txt``) with this run's own key
- ``setsid``, ``double_fork``: a child that leaves the agent's session or is orphaned, marked
  with ESCAPE_MARKER in its argv, left running when the agent exits
- ``fork_bomb``, ``memory``: fork or allocate without end
- ``port``: a TCP connection to 127.0.0.1:ESCAPE_PORT, a loopback port that is not the gateway's
- ``unmount``: the sibling runs' folders, by unmounting what hides them (as itself, then as root of
  a user namespace of its own)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

mode = sys.argv[1]
found: dict[str, object] = {"mode": mode}
marker = sys.argv[2] if len(sys.argv) > 2 else "turnrl-escape"
sleeper = [sys.executable, "-c", "import time; time.sleep(600)", marker]

if mode == "honest":
    time.sleep(float(os.environ.get("HONEST_WAIT", "0")))
elif mode == "write":
    targets = [*os.environ.get("ESCAPE_PATHS", "").split(":"), "../escaped", os.path.expanduser("~/escaped")]
    wrote = []
    for target in filter(None, targets):
        try:
            Path(target).write_text("escaped")
            wrote.append(target)
        except OSError:
            pass
    found["wrote"] = wrote
elif mode == "read":  # other runs' files it knows the paths of, and its own home
    found["seen"] = [t for t in os.environ.get("ESCAPE_PATHS", "").split(":") if t and os.path.exists(t)]
    try:
        Path(os.path.expanduser("~/note.txt")).write_text("mine")
        found["home"] = True
    except OSError:
        found["home"] = False
elif mode == "environ":
    seen = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            data = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        sessions = [v for v in data.split(b"\0") if v.startswith(b"TURNRL_SESSION=")]
        if sessions and sessions[0].decode() != f"TURNRL_SESSION={os.environ['TURNRL_SESSION']}":
            seen.append(pid)  # another run's (or turnrl's own) variables
    found["others"] = seen
    found["processes"] = len(list(filter(str.isdigit, os.listdir("/proc"))))
elif mode == "call":
    target = Path("targets.txt").read_text().split()[0]
    url = os.environ["OPENAI_BASE_URL"].rsplit("/s/", 1)[0] + f"/s/{target}/v1/chat/completions"
    body = json.dumps({"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    request = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
    request.add_header("Authorization", f"Bearer {os.environ['OPENAI_API_KEY']}")
    try:
        found["status"] = urllib.request.urlopen(request, timeout=30).status
    except urllib.error.HTTPError as exc:
        found["status"] = exc.code
elif mode == "setsid":
    subprocess.Popen(sleeper, start_new_session=True)
elif mode == "double_fork":
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, sleeper)
        os._exit(0)
    os.wait()
elif mode == "fork_bomb":
    Path("escape.json").write_text(json.dumps(found))
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.01)
elif mode == "memory":
    hoard = []
    try:
        while True:
            hoard.append(bytearray(64 << 20))
    except MemoryError:
        found["held_mb"] = 64 * len(hoard)
        hoard.clear()
elif mode == "port":
    try:
        with socket.create_connection(("127.0.0.1", int(os.environ["ESCAPE_PORT"])), timeout=5):
            found["connected"] = True
    except OSError as exc:
        found["connected"] = False
        found["error"] = type(exc).__name__
elif mode == "unmount":
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    runs = Path.cwd().parent.parent  # the runs' root: FOLDER is RUNS/NAME/work
    targets = ["/tmp", str(runs), str(runs.parent), str(Path.cwd())]
    read, write = os.pipe()
    if os.fork() == 0:  # a user namespace changes who it is: a child tries, and reports
        own = [t for t in targets if libc.umount2(t.encode(), 2) == 0]  # MNT_DETACH
        if libc.unshare(0x10000000 | 0x00020000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS
            own += [f"userns:{t}" for t in targets if libc.umount2(t.encode(), 2) == 0]
        seen = sorted(os.listdir(runs)) if runs.is_dir() else []
        os.write(write, json.dumps({"unmounted": own, "runs": seen}).encode())
        os._exit(0)
    os.close(write)
    os.wait()
    with os.fdopen(read) as f:
        found.update(json.loads(f.read()))

Path("escape.json").write_text(json.dumps(found))
from openai import OpenAI  # noqa: E402

OpenAI(max_retries=0).chat.completions.create(
    model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4
)
