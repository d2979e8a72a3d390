#!/usr/bin/env bash
# Creates .phoenix-venv with arize-phoenix, the OTLP backend the tracing integration
# tests send spans to (Jaeger cannot be installed on these machines).
#
# Phoenix lives in its own venv because its dependencies (SQLAlchemy, pandas, its own
# opentelemetry and protobuf ranges...) must not move the pins of .venv. Versions of the
# whole tree are fixed by tools/phoenix-constraints.txt (a `pip freeze` of a working
# install), so every machine gets the backend the tests were written against.
# Idempotent: when the venv already holds the pinned phoenix it exits at once.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.phoenix-venv
version=20.26.1
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

if [ -x "$venv/bin/phoenix" ] &&
  [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("arize-phoenix"))' 2>/dev/null)" = "$version" ]; then
  echo "rlserve: $venv already has arize-phoenix $version"
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
constraints=()
[ -f tools/phoenix-constraints.txt ] && constraints=(-c tools/phoenix-constraints.txt)
"$venv/bin/python" -m pip --disable-pip-version-check -q install "${constraints[@]}" "arize-phoenix==$version"
echo "rlserve: arize-phoenix $version ready in $venv"
