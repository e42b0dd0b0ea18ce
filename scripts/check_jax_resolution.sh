#!/usr/bin/env bash
# Does ddiloco install beside current JAX without downgrading it? Resolves (pip --dry-run, nothing is
# installed) ddiloco's wheel with its extras together with pinned jax/jaxlib for another Python.
# Usage: bash scripts/check_jax_resolution.sh [PYTHON_VERSION] [JAX_VERSION]   (default 3.12 0.12.0.1)
# Prints pip's plan; exits non-zero if pip cannot satisfy ddiloco's ranges and the pins together.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
JAXV=${2:-0.12.0.1}
PIP=${PIP:-.venv/bin/pip}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PIP" wheel -q --no-deps -w "$tmp/wheel" . >/dev/null 2>&1
wheel=$(ls "$tmp"/wheel/ddiloco-*.whl)
"$PIP" install -q --dry-run --ignore-installed --only-binary=:all: --python-version "$PYV" \
  --target "$tmp/target" --report "$tmp/report.json" "$wheel[all]" "jax==$JAXV" "jaxlib==$JAXV" 2>/dev/null
python3 - "$tmp/report.json" <<'PY'
import json, sys
plan = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore", "ray"):
  print(f"{name:18s} {plan.get(name, '-')}")
PY
