#!/usr/bin/env bash
# The coding CLI the gateway's harness tests drive: OpenAI's Codex CLI from npm, pinned, in turnrl's
# cache (tests/test_gateway_harnesses.py runs it headless against the gateway on loopback). Node and
# npm come from Debian when missing. Idempotent and quiet: prints one line when it installs.
set -euo pipefail
CODEX_VERSION=0.171.0
CACHE=${TURNRL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/turnrl}
DEST=$CACHE/agents
if [ -x "$DEST/node_modules/.bin/codex" ] && [ "$("$DEST/node_modules/.bin/codex" --version 2>/dev/null)" = "codex-cli $CODEX_VERSION" ]; then
  exit 0
fi
command -v npm >/dev/null || bash "$(dirname "$0")/apt_install.sh" install_agents.sh nodejs npm
mkdir -p "$DEST"
log=$(mktemp)
if ! npm install --prefix "$DEST" --no-audit --no-fund --loglevel=error "@openai/codex@$CODEX_VERSION" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
rm -f "$log"
echo "installed $("$DEST/node_modules/.bin/codex" --version) in $DEST"
