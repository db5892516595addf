#!/usr/bin/env bash
# Build (once) classic TRL 0.11.4 with the libraries of its release (October 2024) at bench/.trl-era-venv: the
# baseline the TRL-tests harness compares rlhf_core against (bench/trl_tests/README.md). torch stays at the
# project's 2.13.0 CPU build (the registry here has no 2024 CPU build); the others are the release-era pins.
# matplotlib: TRL 0.11.4's gpt2-sentiment-control notebook plots with it (bench/trl_examples).
exec bash "$(dirname "$0")/make_venv.sh" .trl-era-venv "trl transformers torch datasets accelerate peft diffusers" \
  trl==0.11.4 transformers==4.45.2 datasets==3.0.1 accelerate==1.0.1 peft==0.13.2 diffusers==0.31.0 torch==2.13.0 \
  rich pytest pillow safetensors tokenizers vaderSentiment numpy matplotlib
