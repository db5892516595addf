#!/usr/bin/env bash
# Build (once) a side-by-side benchmark venv at bench/NAME: torch 2.13.0 FIRST (pip then takes the local CPU
# build, not a multi-GB CUDA one), then the pinned packages; prints the versions of MODULES; a no-op afterwards.
#   make_venv.sh NAME "module module ..." PACKAGE==VERSION ...
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
NAME="$1"
MODULES="$2"
shift 2
VENV="$HERE/$NAME"
STAMP="$VENV/.installed"
PYTHON="${PYTHON:-python3}"
if [ -f "$STAMP" ]; then
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q --disable-pip-version-check"
$PIP torch==2.13.0
$PIP "$@"
# shellcheck disable=SC2086  # one module name per word
"$VENV/bin/python" -c "import importlib, sys; print(' '.join(m + ' ' + importlib.import_module(m).__version__ for m in sys.argv[1:]))" $MODULES
touch "$STAMP"
