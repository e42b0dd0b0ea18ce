#!/usr/bin/env bash
# The e2e tier (whole jobs at length: chaos runs, multi-process learners, shard restarts, the
# notebook): not part of CI's run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One at a time: each e2e test is a long multi-process run that wants the machine to itself.
exec .venv/bin/python -m pytest -m e2e -n 0 "$@"
