#!/usr/bin/env bash
# Set up (if needed), then run the main job: the built-in default model (a small Qwen3-Next-style
# MoE trained by scripts/train_default_model.py) answers a prompt, its routed experts streaming
# from the pack on disk through a host cache smaller than the model (configs/tiny.yaml), followed
# by the expert-tier statistics. Extra arguments go to `lean-qwenflash generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
PROMPT=${PROMPT:-"Write a Python function that returns the squares of a list of numbers."}
exec ${PYTHON:-python3} -m lean_qwenflash generate --config configs/tiny.yaml --prompt "$PROMPT" "$@"
