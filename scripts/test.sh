#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check turnrl tests bench
.venv/bin/ruff format --check turnrl tests bench
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
