#!/usr/bin/env bash
# bubblewrap (bwrap): the sandbox of the code-execution tool (turnrl.tools.sandbox), for
# tests/test_sandbox.py. Idempotent and quiet: prints nothing when bwrap is already there, one line
# when it installs it, apt's log only when apt fails.
set -euo pipefail
command -v bwrap >/dev/null && exit 0
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null; then
  as_root=(sudo -n)
else
  echo "install_sandbox.sh: need root (or sudo) to apt-get install bubblewrap" >&2
  exit 1
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
if ! { "${as_root[@]}" apt-get update -qq && "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
  bubblewrap; } </dev/null >"$log" 2>&1; then
  cat "$log" >&2
  echo "install_sandbox.sh: apt-get install bubblewrap failed" >&2
  exit 1
fi
echo "installed bubblewrap ($(bwrap --version))"
