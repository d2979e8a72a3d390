#!/usr/bin/env bash
# Stages what tools/gpu_smoke.py needs on a GPU machine that has no network, Python 3.12,
# CUDA torch, transformers, peft, grpcio, protobuf, numpy and pytest, but no DeepSpeed,
# pydantic or OpenTelemetry: wheels for Python 3.12 / manylinux x86_64 (DeepSpeed as its
# source, its ops left to build there just in time), into gpu-wheels/ (git-ignored), then
# prints the command that installs them and runs the smoke there.
#
#   bash tools/stage_gpu_wheels.sh [FOLDER]   # needs PyPI; 15 MiB in 26 files, ~10 s
#
# What it downloads (versions: tools/constraints.txt's pins; sizes of 2026-12-07; the
# script fails if the folder passes the 64 MiB a device call carries):
#   deepspeed 0.19.8 source (1.9 MiB): actor and critic training
#   hjson, msgpack, py-cpuinfo, einops, nvidia-ml-py (0.7 MiB): DeepSpeed's requirements
#   setuptools 78.1.1, wheel (1.2 MiB): to build DeepSpeed's source without isolation
#   pydantic 2.14.3, pydantic-core 2.50.4, annotated-types, typing-inspection,
#   typing-extensions (2.7 MiB): rlserve's configs
#   pyyaml 6.0.3 (0.8 MiB), psutil 7.2.2 (0.2 MiB), packaging (0.1 MiB)
#   opentelemetry-api, -sdk, -proto, -exporter-otlp-proto-grpc 1.45.2 with
#   semantic-conventions, exporter-otlp(-proto)-common, googleapis-common-protos (0.8 MiB):
#   rlserve's tracing
#   grpcio 1.85.1 (7.0 MiB), protobuf (0.3 MiB): the exporter's and rlserve's pins
# Not staged: Ray (76 MiB, over a call's limit) and vLLM (311 MiB): their phases SKIP.
set -euo pipefail
cd "$(dirname "$0")/.."
folder=${1:-gpu-wheels}
limit_mib=64

rm -rf "$folder"
mkdir -p "$folder"
pip=(python3 -m pip --disable-pip-version-check -q)
# Requirements resolved for the GPU machine's Python, at rlserve's pins where it has them
# (so pydantic-core is the one pydantic pins). DeepSpeed's source comes apart, without its
# requirements (torch among them): those that machine lacks are named here.
"${pip[@]}" download --dest "$folder" -c tools/constraints.txt --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  pydantic pyyaml psutil opentelemetry-api opentelemetry-sdk opentelemetry-proto \
  opentelemetry-exporter-otlp-proto-grpc hjson msgpack py-cpuinfo einops nvidia-ml-py \
  setuptools wheel 2> >(grep -v "is ignored: it is neither" >&2)
"${pip[@]}" download --dest "$folder" -c tools/constraints.txt --no-binary=:all: --no-deps \
  deepspeed 2> >(grep -v "is ignored: it is neither" >&2)

size_kib=$(du -sk "$folder" | cut -f1)
echo "staged $(ls "$folder" | wc -l) files, $((size_kib / 1024)) MiB in $folder/:"
ls -s --block-size=K "$folder" | tail -n +2 | sed 's/^/  /'
if ((size_kib > limit_mib * 1024)); then
  echo "stage_gpu_wheels: $folder is over the $limit_mib MiB a device call carries" >&2
  exit 1
fi
cat <<EOF

Run on the GPU machine (carry: ["$folder"]):
  export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_INDEX=1 PIP_FIND_LINKS=$folder; pip install -q setuptools wheel && DS_BUILD_OPS=0 pip install -q --no-build-isolation $folder/* && python tools/gpu_smoke.py --out "\$OUT"
EOF
