#!/usr/bin/env bash
# bubblewrap (bwrap): the sandbox of the code-execution tool (turnrl.tools.sandbox), for
# tests/test_sandbox.py. Idempotent and quiet: prints nothing when bwrap is already there.
set -euo pipefail
command -v bwrap >/dev/null && exit 0
bash "$(dirname "$0")/apt_install.sh" install_sandbox.sh bubblewrap
echo "installed bubblewrap ($(bwrap --version))"
