#!/usr/bin/env bash
# Builds llama.cpp (the sources llama-cpp-python vendors) with CMake, once per CPU, and installs
# llama-cpp-python into .venv on top of that build: the GGUF target's tests, its benchmark
# (llama-imatrix, llama-perplexity, llama-quantize) and 'qcompile serve FILE.gguf --engine llama.cpp'
# (llama-server) all run one llama.cpp. Idempotent: a finished build leaves DIR/ready.
#
# DIR = ${QCOMPILE_LLAMA_CPP_DIR:-~/.cache/qcompile/llama.cpp}/<version>-<CPU key>. llama.cpp is
# built for the CPU it runs on (GGML_NATIVE, llama.cpp's own default), so the folder is keyed by
# the CPU's flags: a session on another CPU builds its own and never loads code its CPU cannot run
# (backends/gguf/llama_cpp.py finds the folder the same way). LLAMA_CPP_CMAKE_ARGS adds CMake flags, e.g.
# an AVX2 host's build on an AVX-512 one (with its own QCOMPILE_LLAMA_CPP_DIR):
#   QCOMPILE_LLAMA_CPP_DIR=/tmp/llama-avx2 LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON ..." bash scripts/setup_llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DIR=$(.venv/bin/python -m backends.gguf.llama_cpp --build-dir "$VERSION")
if [ -f "$DIR/ready" ] && .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  exit 0
fi
mkdir -p "$DIR"
export PIP_DISABLE_PIP_VERSION_CHECK=1
SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
[ -f "$SDIST" ] || .venv/bin/pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
[ -d "$DIR/src" ] || { mkdir -p "$DIR/src.tmp" && tar xzf "$SDIST" -C "$DIR/src.tmp" --strip-components=1 && mv "$DIR/src.tmp" "$DIR/src"; }
echo "qcompile: building llama.cpp $VERSION for this CPU into $DIR (a few minutes, once)" >&2
cmake -S "$DIR/src/vendor/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON ${LLAMA_CPP_CMAKE_ARGS:-} > "$DIR/cmake.log" 2>&1
cmake --build "$DIR/build" -j "$(nproc)" --target llama llama-imatrix llama-perplexity llama-quantize llama-server \
  > "$DIR/build.log" 2>&1
# The Python binding only: its own copy of llama.cpp is not built (LLAMA_BUILD=OFF);
# backends/gguf/llama_cpp.py points it at the build above (LLAMA_CPP_LIB_PATH).
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" .venv/bin/pip install -q "$SDIST"
echo "$VERSION" > "$DIR/ready"
