#!/usr/bin/env bash
# Syncer-shard scaling on a 16-core host, within a wall-time budget (default 100 s, start-ups
# included), run from the repository root:
#
#   bash scripts/device_capacity.sh OUT [BUDGET_S]      (RAMP=0.3,0.45,... GB/s per shard core)
#
# scripts/bench_capacity.py with S = 1, 2, 4, 8 syncer shards cut into tensor slices (every shard
# takes a slice of every round, as ddiloco-syncer's shards do), shard i pinned to core i (0-7), the
# fake fleet of M = 8 learners in 8 processes on cores 8-15. The ramp is per shard (S shards are
# offered S times each level, geometric steps of ~1.45) and interleaved over S, each S stopping at
# its first level not kept up with; a point that would end past the budget is skipped
# (--deadline_s). Each point costs ~4.7 s of load (1 s warm-up, 2 windows of 1.5 s) plus its
# processes' start-up (~2-4 s: imports, the shards' values and compiled merges, the fleet's
# registration and pulls) and stop.
#
# Writes OUT/capacity_16core.json after every point ("complete": false until the end) and
# OUT/capacity_16core.txt (everything printed; LOG=... puts it elsewhere). If the budget kills the
# run, the summary of the points it finished is printed from the JSON (bench_capacity.py
# --analyze).
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/device_capacity.sh OUT [BUDGET_S]}
BUDGET=${2:-100}
PY=${PYTHON:-python3}
RAMP=${RAMP:-0.3,0.45,0.65,0.95}
mkdir -p "$OUT"
JSON="$OUT/capacity_16core.json"
LOG="${LOG:-$OUT/capacity_16core.txt}"
if (($(nproc) < 16)); then
  echo "needs 16 cores (shards on 0-7, the fleet on 8-15); this machine has $(nproc)" | tee "$LOG"
  exit 2
fi
{
  echo "capacity, $(date -u +%FT%TZ), repo $(git rev-parse --short HEAD 2>/dev/null || echo '?')," \
    "$($PY -V), load $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -m1 "model name" /proc/cpuinfo
} | tee "$LOG"
# The deadline leaves the coordinator's start-up, a point overrunning its estimate and the summary
# within the budget; timeout is the backstop (its SIGTERM stops every child).
OPENBLAS_NUM_THREADS=1 PYTHONPATH=".:${PYTHONPATH:-}" timeout -k 3 $((BUDGET - 4)) "$PY" scripts/bench_capacity.py \
  --shards=1,2,4,8 --slices --ramp_per_shard --ramp_gbps="$RAMP" \
  --learners=8 --fragments=4 --fragment_mib=32 --warmup_s=1 --windows=2 --window_s=1.5 \
  --shard_cpus=0,1,2,3,4,5,6,7 --fleet_procs=8 --fleet_cpus=8-15 --fleet_send=sendfile \
  --jax_cache --deadline_s=$((BUDGET - 14)) --json="$JSON" 2>&1 \
  | grep --line-buffered -v '^[WI][0-9]\{4\} ' | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if ((rc != 0)) && [[ -f "$JSON" ]]; then
  echo "exit $rc: the summary of the points written before" | tee -a "$LOG"
  PYTHONPATH=".:${PYTHONPATH:-}" "$PY" scripts/bench_capacity.py --analyze="$JSON" 2>&1 | tee -a "$LOG"
fi
exit "$rc"
