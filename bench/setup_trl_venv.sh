#!/usr/bin/env bash
# Build (once) the side-by-side environment with classic TRL 0.11.4 at bench/.trl-venv.
# Classic TRL needs transformers 4.x, so it cannot share .venv (transformers 5.x).
exec bash "$(dirname "$0")/make_venv.sh" .trl-venv "trl transformers torch peft" \
  trl==0.11.4 transformers==4.57.6 accelerate==1.15.0 torch==2.13.0 rich peft safetensors tokenizers vaderSentiment numpy
