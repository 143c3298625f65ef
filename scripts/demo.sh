#!/usr/bin/env bash
# Install diffrt (torch pinned to the CPU build), show the detected platform,
# generate one image with the shipped default model (diffrt-shapes), then one
# clip with the shipped video model (diffrt-motion: --num-frames asks for a
# clip, and without --model a clip is the default video model's).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q -c requirements/cpu.txt -e .
.venv/bin/diffrt env
mkdir -p out
.venv/bin/diffrt generate --model diffrt-shapes \
    --prompt "a red circle on a yellow background in the top left" -o out/shapes.png "$@"
.venv/bin/diffrt generate --num-frames 9 \
    --prompt "a red circle moving left to right on a yellow background" -o out/motion.mp4
