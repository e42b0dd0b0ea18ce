#!/usr/bin/env bash
# The checks of a machine with one GPU and many cores, in one timed pass (about 10 minutes), run
# from the repository root:
#
#   OUT=/some/folder BUDGET_S=560 bash scripts/device_check.sh
#
# With the machine's own python3 (PYTHON=... to override) it
#   1. checks the modules ddiloco needs; missing ones, and those whose version this project does
#      not test, come from wheels in .whl/ (when that folder was brought along), installed without
#      network and without dependencies into a folder of their own put first on PYTHONPATH;
#   2. `codec`: the encoding of δ on the GPU in every codec, within each codec's error bound
#      (scripts/check_device_codec.py), and the host and device paths of one answer timed;
#   3. `table`: the scaling table's final rows (data-parallel and each M's DiLoCo row, as the
#      CPU study's seed-0 sweep chose them) over seeds 1, 2 and 0, many runs at once on the GPU
#      (experiments/scaling_table.py --tier=device): results in $OUT/scaling_table.json;
#   4. `capacity`: scripts/bench_capacity.py with S = 1, 2, 4, 8 syncer shards, each on a core of
#      its own, and the synthetic fleet on the other cores (scripts/device_capacity.sh);
#   5. `sync2b`: the 2B learner on the GPU against a real sharded syncer on the host's cores,
#      syncing against bare steps/s (scripts/bench_learner_overhead.py).
# PHASES (default "codec table capacity sync2b") picks and orders them. Each phase gets at most
# its own limit and never more than what BUDGET_S leaves after the phases still to come have
# their minimum. Everything printed goes to $OUT/summary.txt; each phase's log to $OUT/<phase>.log
# (at most 8 files in $OUT: what a lent machine gives back).
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d)}"
BUDGET_S="${BUDGET_S:-560}"
PHASES="${PHASES:-codec table capacity sync2b}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY"; }

say "device check, $(date -u +%FT%TZ), commit ${DDILOCO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  | sed 's/^/gpu: /' | tee -a "$SUMMARY"
say "cores: $(nproc), python: $("$PY" -V 2>&1)"

# Wheels first on the path: the versions this project tests (flax, optax, orbax, grpcio and
# protobuf for the generated stubs) and what the machine lacks (grain, gin, ...).
if ls .whl/*.whl >/dev/null 2>&1; then
  DEPS="$(mktemp -d)/deps"
  if "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$DEPS" .whl/*.whl \
    >"$OUT/summary.pip" 2>&1; then
    say "installed from .whl/: $(ls .whl | sed 's/-[0-9].*//' | tr '\n' ' ')"
  else
    say "pip install from .whl/ failed:"
    tail -5 "$OUT/summary.pip" | tee -a "$SUMMARY"
  fi
  rm -f "$OUT/summary.pip"
  export PYTHONPATH="$DEPS:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
# Several processes share the GPU: none takes most of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
"$PY" - <<'EOF' 2>&1 | grep -v -e "^I[0-9]" -e "^W[0-9]" | tee -a "$SUMMARY"
import importlib
for m in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "grain", "gin", "grpc",
          "google.protobuf", "ddiloco.learner.learner", "ddiloco.launch.syncer_main"):
    try:
        mod = importlib.import_module(m)
        print(f"import {m}: ok {getattr(mod, '__version__', '')}")
    except Exception as e:  # Reported; the phases below say what failed.
        print(f"import {m}: FAILED {type(e).__name__}: {e}")
import jax
print("devices:", jax.devices())
EOF

START=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - START))); }
# phase NAME LIMIT_S RESERVE_S COMMAND...: runs it for at most LIMIT_S, and at most what is left
# once RESERVE_S (the later phases' minimum) is kept; its output in $OUT/NAME.log, a tail here.
phase() {
  local name=$1 limit=$2 reserve=$3
  shift 3
  local avail=$(($(left) - reserve))
  ((avail < limit)) && limit=$avail
  say ""
  say "== $name (at most ${limit} s): $*"
  if ((limit < 20)); then
    say "-- $name: skipped, no time left"
    return 0
  fi
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -e "^I[0-9]" -e "^W[0-9]" -e "Path not found" "$OUT/$name.log" | tail -n 40 \
    | tee -a "$SUMMARY"
  say "-- $name: exit $rc after $((SECONDS - t0)) s"
}

# What each phase may take, and its least useful share (kept for it while earlier phases run).
declare -A LIMIT=([codec]=40 [table]=270 [capacity]=100 [sync2b]=150)
declare -A LEAST=([codec]=20 [table]=150 [capacity]=60 [sync2b]=120)
# slot NAME RESERVE_S: the seconds phase NAME gets (its limit, or what is left once RESERVE_S is kept).
slot() {
  local t=$(($(left) - $2))
  ((t > LIMIT[$1])) && t=${LIMIT[$1]}
  echo "$t"
}
run_phase() {
  local name=$1 reserve=$2
  case $name in
    codec)
      phase codec "${LIMIT[codec]}" "$reserve" "$PY" scripts/check_device_codec.py --timing_mib=64
      ;;
    table)
      # The table's runs: fp32 with fp32 matrix products (as on the CPU: no TF32), deterministic
      # reductions where XLA offers them, 12 at once, each pinned to a core.
      local t
      t=$(slot table "$reserve")
      JAX_DEFAULT_MATMUL_PRECISION=highest \
        XLA_FLAGS="--xla_force_host_platform_device_count=8 ${TABLE_XLA_FLAGS:-}" \
        phase table "$t" "$reserve" "$PY" experiments/scaling_table.py --tier=device \
        --seeds=1,2,0 --workers="${TABLE_WORKERS:-12}" --out="$OUT" \
        --workdir=workdirs/scaling_table_device --start_until_s=$((t * 6 / 10)) \
        --stop_at_s=$((t - 15))
      # A failed run's log, for the reasons.
      for f in workdirs/scaling_table_device/*/seed_*.log; do
        [ -f "$f" ] || continue
        if ! [ -f "${f%.log}.result.json" ]; then
          { echo "--- $f"; tail -n 15 "$f"; } >>"$OUT/table.log"
        fi
      done
      ;;
    capacity)
      local t
      t=$(slot capacity "$reserve")
      # Its own log is this phase's: only the JSON comes back beside it.
      LOG="$(mktemp)" phase capacity "$t" "$reserve" bash scripts/device_capacity.sh "$OUT" "$t"
      ;;
    sync2b)
      # 2,115M parameters (byte vocabulary), bf16 with remat, 8 x 1024 tokens a step; 4 shards on
      # cores 6-15, the learner on 0-5.
      local t
      t=$(slot sync2b "$reserve")
      phase sync2b "$t" "$reserve" "$PY" scripts/bench_learner_overhead.py --size=2b --devices=0 \
        --batch=8 --seq_len=1024 --shards=4 --learner_cpus=0-5 --syncer_cpus=6-15 \
        --syncer_blas_threads=1 --skip=36 --steps=40 --rounds=1 --bare=bare,bare_async \
        --deadline_s=$((t - 10)) --json="$OUT/sync2b.json"
      ;;
  esac
}

phases=($PHASES)
for i in "${!phases[@]}"; do
  reserve=0
  for later in "${phases[@]:i+1}"; do
    reserve=$((reserve + LEAST[$later]))
  done
  run_phase "${phases[$i]}" "$reserve"
done
say ""
say "done after $((SECONDS - START)) s of a budget of $BUDGET_S s"
