#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with ddiloco and its test tools installed.
# Usage: bash scripts/setup.sh   (from the repository root; re-running is cheap)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ddiloco-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".[all,test]"
  touch "$stamp"
fi
