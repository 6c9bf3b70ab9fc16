#!/usr/bin/env bash
# The GPU check in one call (bench/gpu_check.py): build a Qwen3-0.6B-shape model, the embedded
# engine against `generate`, a trainer step against TRL (bf16, CUDA peak memory), a 3-step
# `turnrl train` on CUDA, a 2-rank data-parallel run when there are 2 GPUs; one table at the end.
# On a bare CUDA image (torch, transformers, accelerate, peft; no network): run
# `bash scripts/gpu_wheels.sh` where PyPI is reachable first, and bring .whl/ with the repository.
#   bash scripts/gpu_check.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${TMPDIR:-/tmp}/turnrl-gpu-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py "$@"
