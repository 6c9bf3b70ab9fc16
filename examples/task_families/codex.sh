#!/usr/bin/env bash
# OpenAI's Codex CLI, unchanged (bash scripts/install_agents.sh puts it in turnrl's cache; CODEX names
# it), headless on the task in "$1", its model provider the run's gateway (OPENAI_BASE_URL and
# OPENAI_API_KEY: turnrl sets both for each run) and its instructions codex.md. Its own sandbox is
# off (danger-full-access): the run is in turnrl's, which lets it write the run's folder only.
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
export CODEX_HOME=${CODEX_HOME:-$(mktemp -d)}  # its sessions and logs, outside the task's folder
provider="{name=\"turnrl\", base_url=\"$OPENAI_BASE_URL\", wire_api=\"responses\", env_key=\"OPENAI_API_KEY\"}"
exec "${CODEX:-codex}" exec --skip-git-repo-check -s danger-full-access -m policy \
  -c model_provider=turnrl -c "model_providers.turnrl=$provider" \
  -c "model_instructions_file=$here/codex.md" "$1"
