#!/usr/bin/env bash
# Install diffrt (torch pinned to the CPU build), show the detected platform,
# then generate one image with the shipped default model (diffrt-shapes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q -c requirements/cpu.txt -e .
.venv/bin/diffrt env
mkdir -p out
.venv/bin/diffrt generate --model diffrt-shapes \
    --prompt "a red circle on a yellow background in the top left" -o out/shapes.png "$@"
