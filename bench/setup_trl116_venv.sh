#!/usr/bin/env bash
# Build (once) the side-by-side environment with TRL 1.16.0 at bench/.trl116-venv (issue 14 point 6).
# trl 1.16 pins none of its dependencies, so every version is pinned here (docs/ENVIRONMENT.md).
# torch is installed FIRST and pinned, so pip takes the local CPU build instead of a CUDA one.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$HERE/.trl116-venv"
STAMP="$VENV/.installed"
PYTHON="${PYTHON:-python3}"
if [ -f "$STAMP" ]; then
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q --disable-pip-version-check"
$PIP torch==2.13.0
$PIP trl==1.16.0 transformers==5.23.0 accelerate==1.15.0 datasets==5.2.0 torch==2.13.0 vaderSentiment numpy
"$VENV/bin/python" -c "import trl, transformers, torch, datasets; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__, 'datasets', datasets.__version__)"
touch "$STAMP"
