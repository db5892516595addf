#!/usr/bin/env bash
# Run classic TRL 0.11.4's own unit tests against rlhf_core (default) or against trl 0.11.4 itself: with today's
# libraries (--trl, bench/.trl-venv) or with those of its release, October 2024 (--trl-era, bench/.trl-era-venv).
#   bench/trl_tests/run.sh [--trl | --trl-era] TRL_CHECKOUT [pytest args...]
# TRL_CHECKOUT: a checkout of github.com/huggingface/trl at tag v0.11.4 (the PyPI sdist and wheel ship no tests):
#   git clone --depth 1 --branch v0.11.4 https://github.com/huggingface/trl bench/.cache/trl-v0.11.4
# Hub ids are served by local random-weight models (fixtures.py); nothing is downloaded.
#   bench/trl_tests/run.sh --all TRL_CHECKOUT [pytest args...]   all three, then rlhf_core against each baseline
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
if [ "${1:-}" = "--all" ]; then
  shift
  for mode in --trl-era --trl ""; do bash "$0" $mode "$@"; done
  PYTHON_CMP="${PYTHON:-$REPO/.venv/bin/python}"
  "$PYTHON_CMP" "$HERE/compare.py" "$HERE/.work/trl-era/junit.xml" "$HERE/.work/rlhf_core/junit.xml" \
    "release-era libraries"
  "$PYTHON_CMP" "$HERE/compare.py" "$HERE/.work/trl/junit.xml" "$HERE/.work/rlhf_core/junit.xml" "today's libraries"
  exit 0
fi
MODE=rlhf_core
case "${1:-}" in
  --trl) MODE=trl; shift ;;
  --trl-era) MODE=trl-era; shift ;;
esac
CHECKOUT="${1:?usage: run.sh [--trl | --trl-era] TRL_CHECKOUT [pytest args]  (a trl v0.11.4 checkout, see README.md)}"
shift
test -f "$CHECKOUT/tests/test_core.py" || { echo "no tests/test_core.py under $CHECKOUT: not a trl checkout" >&2; exit 2; }
# TRL_TEST_FILES="test_dpo_trainer.py ..." runs a subset.
TEST_FILES=(${TRL_TEST_FILES:-test_core.py test_modeling_value_head.py test_ppo_trainer.py test_reward_trainer.py
            test_sft_trainer.py test_dpo_trainer.py test_ddpo_trainer.py})

if [ "$MODE" = trl ]; then
  "$REPO/bench/setup_trl_venv.sh"
  PY="$REPO/bench/.trl-venv/bin/python"
  "$PY" -c "import pytest, PIL" 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check pytest pillow  # the tests import PIL
  PYPATH=""
elif [ "$MODE" = trl-era ]; then
  "$REPO/bench/setup_trl_era_venv.sh"   # trl 0.11.4 with transformers 4.45.2, datasets 3.0.1, ... (and pytest, PIL)
  PY="$REPO/bench/.trl-era-venv/bin/python"
  PYPATH=""
else
  PY="${PYTHON:-$REPO/.venv/bin/python}"   # the project's venv (make setup), or PYTHON=another interpreter
  PYPATH="$HERE/shim:$REPO"   # `trl` is the shim that aliases rlhf_core
fi

WORK="$HERE/.work/$MODE"
mkdir -p "$WORK"
# The tests' own extra dependency, installed once beside (not into) the interpreter's environment.
EXTRAS="$HERE/.work/extras"
if ! PYTHONPATH="$EXTRAS" "$PY" -c "import parameterized" 2>/dev/null; then
  "$PY" -m pip install -q --disable-pip-version-check --target "$EXTRAS" parameterized
fi
PYPATH="${PYPATH:+$PYPATH:}$EXTRAS"
FIXTURES_MD5="$(md5sum "$HERE/fixtures.py" | cut -d' ' -f1)"
if [ "$(cat "$WORK/.fixtures" 2>/dev/null)" != "$FIXTURES_MD5" ]; then  # cached: they only depend on fixtures.py
  PYTHONPATH="$PYPATH" "$PY" "$HERE/fixtures.py" "$WORK" >"$WORK/fixtures.log" 2>&1
  echo "$FIXTURES_MD5" >"$WORK/.fixtures"
fi
rm -rf "$WORK/tests" && cp -r "$CHECKOUT/tests" "$WORK/tests" && rm -rf "$WORK/tests/slow"
if [ "$MODE" = rlhf_core ]; then cp "$HERE/conftest.py" "$WORK/conftest.py"; else rm -f "$WORK/conftest.py"; fi

cd "$WORK"
export PYTHONPATH="$PYPATH" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
  WANDB_DISABLED=true MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
"$PY" -m pytest "${TEST_FILES[@]/#/tests/}" -q -p no:cacheprovider -o addopts="" --rootdir="$WORK" --continue-on-collection-errors \
  --junitxml="$WORK/junit.xml" "$@" >"$WORK/pytest.log" 2>&1
RC=$?
set -e
"$PY" "$HERE/summarize.py" "$WORK/junit.xml" "$MODE"
echo "full log: $WORK/pytest.log"
exit 0
