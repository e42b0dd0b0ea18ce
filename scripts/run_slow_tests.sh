#!/usr/bin/env bash
# The slow suite (long runs, multi-process chaos): not part of CI's default run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One at a time: each slow test is a long multi-process run that wants the machine to itself.
exec .venv/bin/python -m pytest -m slow -n 0 "$@"
