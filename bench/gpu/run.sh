#!/usr/bin/env bash
# The GPU bench in one command, on a machine with one NVIDIA GPU and no network:
#
#     bash bench/gpu/run.sh                 # writes bench/results-gpu.{json,md}; ~9 min (BUDGET_S, default 520)
#     SMOKE=1 bash bench/gpu/run.sh         # the same runner, rows and installs on a CPU at tiny sizes
#     ONLY="ppo fp32,parity" PASSES=1 bash bench/gpu/run.sh   # just those rows (labels; every library of each)
#
# Needs bench/gpu/bundle/ (`make bench-gpu-bundle` on a machine that reaches the package index; see docs/bench.md).
# Installs the bundle's three library sets into --target folders (rlhf_core on transformers 5.23; classic TRL 0.11.4
# on transformers 4.57.6; TRL 1.16), then bench/gpu/driver.py runs the rows: every workload a fresh process, ours
# and the peer alternating, CUDA synchronised before every timer read, within the budget. With no bundle, SMOKE=1
# uses the local venvs (.venv, bench/.trl-venv, bench/.trl116-venv) as the library sets instead.
# When $OUT is set (the device tool sets it), the results and the log are also copied there, after every row.
set -uo pipefail
START=$(date +%s)
cd "$(dirname "$0")/../.." || exit 1  # the repository root
export SMOKE=${SMOKE:-0}
# GPU: 520 s fits the device tool's 600 s per command (docs/bench.md: one 15-minute slot); smoke: every row runs
if [ "$SMOKE" = 1 ]; then BUDGET_S=${BUDGET_S:-1200}; else BUDGET_S=${BUDGET_S:-520}; fi
export DEADLINE=$((START + BUDGET_S))
BUNDLE=${BUNDLE:-bench/gpu/bundle}
WORK=${WORK:-${TMPDIR:-/tmp}/rlhf-gpu-bench}
if [ "$SMOKE" = 1 ]; then DEFAULT_RESULTS="$WORK/results-gpu"; else DEFAULT_RESULTS="$PWD/bench/results-gpu"; fi
export RESULTS=${RESULTS:-$DEFAULT_RESULTS}
export BENCH_CACHE=${BENCH_CACHE:-$WORK/cache}
if [ -d "$BUNDLE/data/rt-polarity" ]; then export RT_POLARITY_DIR=${RT_POLARITY_DIR:-$PWD/$BUNDLE/data/rt-polarity}; fi
export HF_HOME=${HF_HOME:-$WORK/hf-home} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false WANDB_DISABLED=true DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
rm -rf "$WORK/site-"* "$BENCH_CACHE"
mkdir -p "$WORK" "$BENCH_CACHE" "$HF_HOME" "$(dirname "$RESULTS")"
export LOG="$WORK/log.txt"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

finish() {  # copy what there is to $OUT (the device tool returns only that folder)
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp -f "$RESULTS.json" "$RESULTS.md" "$OUT/" 2>/dev/null
    cp -f "$LOG" "$OUT/gpu-bench-log.txt" 2>/dev/null
  fi
}
trap finish EXIT

# The machine's interpreter, which has torch: python3 (PY=... names another). SMOKE: the project's .venv.
if [ -z "${PY:-}" ]; then
  if [ "$SMOKE" = 1 ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "gpu bench: $PY cannot import torch; name the interpreter that can: PY=<python with torch> bash bench/gpu/run.sh" >&2
  exit 2
fi
echo "== $(date -u +%FT%TZ) SMOKE=$SMOKE budget ${BUDGET_S}s python $PY results $RESULTS"
(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader) \
  || echo "nvidia-smi: none"

if [ -d "$BUNDLE/wheels" ]; then
  T0=$(date +%s)
  pids=()
  for set in ours trl trl116; do
    "$PY" bench/gpu/install.py "$set" "$WORK/site-$set" --bundle "$BUNDLE" > "$WORK/install-$set.log" 2>&1 &
    pids+=($!)
  done
  failed=0
  for i in 0 1 2; do wait "${pids[$i]}" || failed=1; done
  tail -q -n 1 "$WORK"/install-*.log
  if [ "$failed" != 0 ]; then
    echo "FATAL: a wheel install failed"; cat "$WORK"/install-*.log; exit 2
  fi
  echo "== installs in $(( $(date +%s) - T0 )) s"
  export PY_OURS=$PY PY_TRL=$PY PY_TRL116=$PY
  export SITE_OURS=$WORK/site-ours SITE_TRL=$WORK/site-trl SITE_TRL116=$WORK/site-trl116
elif [ "$SMOKE" = 1 ]; then
  echo "== no bundle at $BUNDLE: the local venvs stand in for the library sets"
  export PY_OURS=.venv/bin/python PY_TRL=bench/.trl-venv/bin/python PY_TRL116=bench/.trl116-venv/bin/python
  export SITE_OURS="" SITE_TRL="" SITE_TRL116=""
else
  echo "FATAL: no bundle at $BUNDLE: run \`make bench-gpu-bundle\` on a machine that reaches the package index"
  exit 2
fi

"$PY" bench/gpu/driver.py
RC=$?
echo "== driver rc=$RC, $(( $(date +%s) - START )) s in all; $RESULTS.{json,md}"
exit $RC
