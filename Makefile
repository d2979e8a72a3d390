# The two commands README documents: `make demo` (main job on the embedded default)
# and `make test` (everything CI checks). Both set the environment up first; `make test`
# also installs Phoenix (.phoenix-venv), the OTLP backend of the tracing tests.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYPROJECTS := $(wildcard libs/*/pyproject.toml services/*/pyproject.toml)

.PHONY: setup demo test test-fast lint protos

$(STAMP): tools/setup.sh tools/constraints.txt $(PYPROJECTS)
	bash tools/setup.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlserve train

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/buf lint

# Three pytest sessions: the multi-node placement tests start their own simulated cluster
# (one process can hold only one Ray), and the two-node tests a real one in network
# namespaces (root only), driven from outside. The GPU smoke's phases run first on the CPU
# (its Serve phase starts a Ray cluster, which must not meet the test session's).
test: lint
	bash tools/setup_phoenix.sh
	$(BIN)/python tools/gpu_smoke.py --cpu --out runs/gpu-smoke
	$(BIN)/python -m pytest
	RLSERVE_MULTINODE_TESTS=1 $(BIN)/python -m pytest integration_tests/multinode
	RLSERVE_NETNS_TESTS=1 $(BIN)/python -m pytest integration_tests/netns

# The fast tier: no Ray cluster, no slow end-to-end runs, no lint (a few minutes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not cluster and not slow" libs services tools/tests

# Regenerates the committed Python stubs from proto/ (a test checks they are fresh).
protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py
