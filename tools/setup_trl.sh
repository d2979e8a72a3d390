#!/usr/bin/env bash
# Creates .trl-venv with TRL, the single-process baseline of benchmarks/bench_vs_trl.py.
#
# TRL is no dependency of rlserve: it lives in its own venv so its requirements never move
# the pins of .venv. torch is installed first and pinned (the local CPU build; asking pip
# for any other torch downloads a multi-GB CUDA build), then TRL with the same
# transformers, peft and accelerate as .venv, so both systems run the same kernels.
# Idempotent: when the venv already holds the pinned TRL it exits at once.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.trl-venv
version=1.12.0
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

if [ -x "$venv/bin/python" ] &&
  [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("trl"))' 2>/dev/null)" = "$version" ]; then
  echo "rlserve: $venv already has trl $version"
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
pins=(torch==2.13.0 "$(grep -m1 '^transformers==' tools/constraints.txt)"
  "$(grep -m1 '^peft==' tools/constraints.txt)" "$(grep -m1 '^accelerate==' tools/constraints.txt)")
"${pip[@]}" install torch==2.13.0
"${pip[@]}" install "${pins[@]}" "trl==$version" datasets requests
echo "rlserve: trl $version ready in $venv"
