#!/usr/bin/env bash
# The slow suite (long runs, multi-process chaos): not part of CI's default run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -m slow "$@"
