#!/usr/bin/env bash
# Build (once) the side-by-side environment with TRL 1.16.0 at bench/.trl116-venv (issue 14 point 6).
# trl 1.16 pins none of its dependencies, so every version is pinned here (docs/ENVIRONMENT.md).
exec bash "$(dirname "$0")/make_venv.sh" .trl116-venv "trl transformers torch datasets" \
  trl==1.16.0 transformers==5.23.0 accelerate==1.15.0 datasets==5.2.0 torch==2.13.0 vaderSentiment numpy \
  peft==0.21.2 math-verify==0.9.0  # the KTO LoRA snippet; trl.rewards.accuracy_reward (docs/trl_clients.md)
