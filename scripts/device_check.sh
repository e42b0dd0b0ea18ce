#!/usr/bin/env bash
# A short check on a machine with one GPU (about 5 minutes), run from the repository root:
#
#   OUT=/some/folder bash scripts/device_check.sh
#
# With the machine's own python3 (PYTHON=... to override) it
#   1. checks the modules the learner needs; missing ones are installed, without network and
#      without dependencies, from wheels in .whl/ (if that folder was brought along) into a
#      folder of their own put first on PYTHONPATH;
#   2. checks the encoding of δ on the GPU in every codec: within each codec's error bound
#      (scripts/check_device_codec.py), and times the host and device paths of one answer;
#   3. runs scripts/bench_learner_step.py for the tiny and the small model on 1 GPU (the commands
#      of docs/results.md, "On a GPU").
# Everything printed also goes to $OUT (default: a temporary folder): summary.txt and one log
# per step. The exit status is that of the bit-exactness check.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY"; }

say "device check, $(date -u +%FT%TZ), repo $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  | sed 's/^/gpu: /' | tee -a "$SUMMARY"

# Module -> wheel name, for what the learner imports beyond jax/flax/optax.
missing=$("$PY" - <<'EOF'
import importlib.util
need = {
    "jax": "jax", "flax": "flax", "optax": "optax", "absl": "absl-py", "numpy": "numpy",
    "ml_dtypes": "ml_dtypes", "xxhash": "xxhash", "grain": "grain", "gin": "gin-config",
    "etils": "etils", "orbax": "orbax-checkpoint", "grpc": "grpcio", "google.protobuf": "protobuf",
    "tree": "dm-tree", "array_record": "array-record", "scipy": "scipy",
}
def found(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(w for m, w in need.items() if not found(m)))
EOF
)
say "python: $("$PY" -V 2>&1); missing modules: ${missing:-none}"
if [ -n "$missing" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    DEPS="$(mktemp -d)/deps"
    "$PY" -m pip install --quiet --no-index --no-deps --target "$DEPS" .whl/*.whl \
      >"$OUT/pip.log" 2>&1 && say "installed from .whl/: $(ls .whl | tr '\n' ' ')" \
      || say "pip install from .whl/ failed (see pip.log)"
    export PYTHONPATH="$DEPS:${PYTHONPATH:-}"
  else
    say "no .whl/ folder: bring the wheels of [$missing] for Python 3.12 in .whl/"
  fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib
for m in ("jax", "flax", "optax", "grain", "xxhash", "ddiloco.learner.learner"):
    try:
        mod = importlib.import_module(m)
        print(f"import {m}: ok {getattr(mod, '__version__', '')}")
    except Exception as e:  # Reported, and the steps below say what failed.
        print(f"import {m}: FAILED {type(e).__name__}: {e}")
import jax
print("devices:", jax.devices())
EOF

step() {  # step NAME TIMEOUT_S COMMAND...: runs it, its output in $OUT/NAME.log, tail in summary.
  local name=$1 limit=$2
  shift 2
  say ""
  say "== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -e "^I[0-9]" -e "^W[0-9]" "$OUT/$name.log" | tail -n 30 | tee -a "$SUMMARY"
  say "-- $name: exit $rc after $((SECONDS - t0)) s"
  return $rc
}

step device_codec 150 "$PY" scripts/check_device_codec.py --timing_mib=64
exact=$?
step learner_step_tiny 75 "$PY" scripts/bench_learner_step.py --size=tiny --devices=1 \
  --steps=40 --rounds=2
step learner_step_small 100 "$PY" scripts/bench_learner_step.py --size=small --devices=1 \
  --batch=16 --seq_len=512 --steps=30 --rounds=2
say ""
say "bit-exactness check exit status: $exact (0: every case equal or flagged)"
exit "$exact"
