#!/usr/bin/env bash
# Install diffrt with its test and Ray extras (torch pinned to the CPU build) and
# Debian's chromium (the playground's browser test), then run ruff, mypy over
# diffrt/ and the whole test suite. Idempotent. pytest's exit code 5 ("no tests
# ran") fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q -c requirements/cpu.txt -e '.[test,ray,quant]' ./tests/plugins/diffrt_simdevice
# the playground's browser test (DIFFRT_CHROMIUM names another one)
if [ -z "${DIFFRT_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    APT="$SUDO env DEBIAN_FRONTEND=noninteractive apt-get"
    $APT install -y -qq --no-install-recommends chromium >/dev/null \
        || { $APT update -qq && $APT install -y -qq --no-install-recommends chromium >/dev/null; }
fi
.venv/bin/ruff check diffrt tests benchmarks examples
.venv/bin/mypy diffrt
.venv/bin/python -m pytest -q --durations=30 "$@"
