#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU) for the real-server tests and for users without a GPU
# inference server. The sources are the llama.cpp vendored in the llama-cpp-python sdist from
# PyPI (pinned below); its convert_hf_to_gguf.py turns a Hugging Face model into a GGUF.
# Idempotent: a finished install is reused, an interrupted build resumes where it stopped.
# Result: $DEST/bin/llama-server and $DEST/src/convert_hf_to_gguf.py, where DEST is
# $TURNRL_LLAMA_CPP_HOME or <turnrl cache>/llama.cpp (default ~/.cache/turnrl/llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36 # llama-cpp-python sdist; keep in step with LLAMA_CPP_PYTHON_VERSION in turnrl/engines/servers.py
CACHE=${TURNRL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/turnrl}
DEST=${TURNRL_LLAMA_CPP_HOME:-$CACHE/llama.cpp}
SRC="$DEST/src-$VERSION"
# the build is for this CPU (ggml compiles for the native instruction set): a cache carried to a
# machine with another CPU is rebuilt, never resumed (its objects die there with SIGILL)
CPU=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12)-avx2
# not -march=native: a CPU that lists AMX (Sapphire Rapids) under a VM that does not enable its
# tile state dies with SIGILL in ggml's AMX kernels; AVX2 + FMA + F16C run on every x86-64 server
ISA=""
[ "$(uname -m)" != x86_64 ] ||
  ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
BUILD="$DEST/build-$VERSION-$CPU"
# TURNRL_SERVER_PYTHON: the Python whose pip downloads the sources (default: .venv's, else python3);
# scripts/test.sh sets it to python3 to build beside setup.sh, and TURNRL_SERVER_DEPS=0 to leave the
# converter's packages to setup.sh (its [hf] extra) instead of installing them into .venv meanwhile
PY=${TURNRL_SERVER_PYTHON:-.venv/bin/python}
[ -x "$PY" ] || command -v "$PY" >/dev/null || PY=python3
JOBS=${JOBS:-$(nproc)}

if [ -x "$DEST/bin/llama-server" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION $CPU" ]; then
  echo "llama-server (llama-cpp-python $VERSION sources) is installed in $DEST"
  [ -z "${TURNRL_SERVER_SOURCES_READY:-}" ] || touch "$TURNRL_SERVER_SOURCES_READY"
  exit 0
fi

command -v cmake >/dev/null && command -v g++ >/dev/null && command -v make >/dev/null ||
  bash scripts/apt_install.sh install_server.sh cmake g++ make
# GGUF conversion runs in the project's Python: it needs these (setup.sh's [hf] extra has them).
[ "${TURNRL_SERVER_DEPS:-1}" = 0 ] || "$PY" -c "import gguf, sentencepiece" 2>/dev/null ||
  "$PY" -m pip install -q gguf sentencepiece

mkdir -p "$DEST"
SDIST="$DEST/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  TMP=$(mktemp -d "$DEST/.download.XXXXXX")
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP"
  mv "$TMP/llama_cpp_python-$VERSION.tar.gz" "$SDIST"
  rm -rf "$TMP"
fi
if [ ! -f "$SRC/.extracted" ]; then
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar -xzf "$SDIST" -C "$SRC" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
  rm -f "$SRC/.git" # a submodule link to a repository that is not there
  touch "$SRC/.extracted"
fi
# the sources (the converter, the vocabularies under src/models) are usable before the compile ends:
# TURNRL_SERVER_SOURCES_READY names a file made once they are (scripts/test.sh starts the tests then)
ln -sfn "src-$VERSION" "$DEST/src"
[ -z "${TURNRL_SERVER_SOURCES_READY:-}" ] || touch "$TURNRL_SERVER_SOURCES_READY"

# CPU only, one static binary; no web UI (its prebuilt assets would be downloaded), no TLS;
# the build-info step gets no git (GIT_EXECUTABLE=/bin/false: the version reads "unknown").
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGIT_EXECUTABLE=/bin/false \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DGGML_OPENMP=OFF $ISA >"$DEST/cmake.log" 2>&1 || { tail -20 "$DEST/cmake.log" >&2; exit 1; }
nice cmake --build "$BUILD" --target llama-server -j "$JOBS" >"$DEST/build.log" 2>&1 ||
  { tail -20 "$DEST/build.log" >&2; exit 1; }

mkdir -p "$DEST/bin"
cp "$BUILD/bin/llama-server" "$DEST/bin/llama-server.new"
mv "$DEST/bin/llama-server.new" "$DEST/bin/llama-server"
echo "$VERSION $CPU" >"$DEST/VERSION"
rm -rf "$BUILD" "$SDIST" # the binary and the sources are all that is used from here on
echo "llama-server installed: $DEST/bin/llama-server"
