# The two commands README documents: `make demo` (main job on the embedded default)
# and `make test` (everything CI checks). Both set the environment up first.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYPROJECTS := $(wildcard libs/*/pyproject.toml services/*/pyproject.toml)

.PHONY: setup demo test lint protos

$(STAMP): tools/setup.sh tools/constraints.txt $(PYPROJECTS)
	bash tools/setup.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m rlserve.core.embedded.demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/buf lint

test: lint
	$(BIN)/python -m pytest

# Regenerates the committed Python stubs from proto/ (a test checks they are fresh).
protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py
