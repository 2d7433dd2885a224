#!/usr/bin/env bash
# Set up lean-qwenflash on a fresh machine: system packages (liburing for the io_uring engine),
# torch, then this package in editable mode.
#   scripts/setup.sh          what the main job needs (scripts/run.sh), nothing else
#   scripts/setup.sh --test   plus the test-only dependencies (scripts/test.sh, CI): the llama.cpp
#                             oracle (llama-cpp-python, built from source once) and the dev extras
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST_DEPS=0
case "${1:-}" in
  --test) TEST_DEPS=1 ;;
  "") ;;
  *) echo "setup.sh: unknown argument '$1' (use --test for the test-only dependencies)" >&2; exit 2 ;;
esac

if ! pkg-config --exists liburing 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing liburing-dev and pkg-config with apt"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev pkg-config >/dev/null
  else
    echo "setup: liburing-dev not found and cannot apt-get it (not root?); building the pread engine only"
  fi
fi

# Headless Chromium renders the dashboard (/ui) in tests/test_ui.py: a test-only Debian package.
if [ "$TEST_DEPS" = 1 ] && ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing chromium with apt (the dashboard test's browser)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: chromium not found and cannot apt-get it (not root?); tests/test_ui.py's browser test will skip"
  fi
fi

# torch first: a bare `torch` requirement on a machine without it pulls a multi-GB CUDA build.
# On a CUDA machine install the torch build you want before running this script.
if ! $PY -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q "setuptools>=64" wheel "pybind11>=2.12"
# llama.cpp through llama-cpp-python is the tests' oracle for GGUF files and quantized compute. It
# builds llama.cpp from source (~9 min on 2 cores) once; pip's wheel cache makes later runs instant.
# Built for AVX2 (not -march=native) so the cached wheel runs on every machine of this kind.
if [ "$TEST_DEPS" = 1 ] && ! $PY -c "import llama_cpp" 2>/dev/null; then
  echo "setup: building llama-cpp-python ${LLAMA_CPP_PYTHON_VERSION:=0.3.36} (once; then pip's wheel cache)"
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" $PY -m pip install -q "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
if [ "$TEST_DEPS" = 1 ]; then
  $PY -m pip install -q --no-build-isolation -e '.[dev]'
else
  $PY -m pip install -q --no-build-isolation -e .
fi
$PY -c "import lean_qwenflash._io as io; print('setup: native I/O engine built', '(io_uring + pread)' if io.uring_compiled() else '(pread only)')"
