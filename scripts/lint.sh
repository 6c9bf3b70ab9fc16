#!/usr/bin/env bash
# Lint, format check, types and the docs site (scripts/test.sh runs it beside the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check turnrl tests bench
.venv/bin/ruff format --check turnrl tests bench
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
