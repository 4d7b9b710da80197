#!/usr/bin/env bash
# The main job end to end on the built-in example model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/qcompile example "$@"
