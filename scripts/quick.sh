#!/usr/bin/env bash
# The inner loop: lint, types and the tests that need no server, browser or sandbox and do not run
# the CLI end to end (tests/conftest.py's NOT_QUICK), in a few minutes on 2 cores. It sets up
# `.venv` only. `bash scripts/test.sh` (what CI runs) is the whole check.
set -euo pipefail
cd "$(dirname "$0")/.."
export TURNRL_CONSTRAINTS=${TURNRL_CONSTRAINTS:-scripts/constraints/test.txt}
bash scripts/setup.sh
.venv/bin/ruff check turnrl tests bench
.venv/bin/ruff format --check turnrl tests bench
.venv/bin/mypy
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
.venv/bin/python -m pytest -q -n "${TURNRL_TEST_WORKERS:-2}" --quick "$@"
