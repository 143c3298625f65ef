#!/usr/bin/env bash
# Install diffrt with its test extras (torch pinned to the CPU build) and run
# ruff plus the whole test suite. pytest's exit code 5 ("no tests ran") fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q -c requirements/cpu.txt -e '.[test]' ./tests/plugins/diffrt_simdevice
.venv/bin/ruff check diffrt tests benchmarks
.venv/bin/python -m pytest -q "$@"
