#!/usr/bin/env bash
# Build (once) the side-by-side environment with classic TRL 0.11.4 at bench/.trl-venv.
# Classic TRL needs transformers 4.x, so it cannot share .venv (transformers 5.x).
# torch is installed FIRST and pinned, so pip takes the local CPU build instead of a CUDA one.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$HERE/.trl-venv"
STAMP="$VENV/.installed"
PYTHON="${PYTHON:-python3}"
if [ -f "$STAMP" ]; then
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q --disable-pip-version-check"
$PIP torch==2.13.0
$PIP trl==0.11.4 transformers==4.57.6 accelerate==1.15.0 torch==2.13.0 rich peft safetensors tokenizers vaderSentiment numpy
"$VENV/bin/python" -c "import trl, transformers, torch, peft; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
touch "$STAMP"
