# Shared fixtures (one Ray + Serve per session, tiny models) for every package's tests.
import os

pytest_plugins = ["rlserve.core.testing"]

# The multi-node tests run their own simulated cluster, and a process holds one Ray: they
# are a second pytest session (`make test` runs both; see integration_tests/multinode).
collect_ignore = (
    [] if os.environ.get("RLSERVE_MULTINODE_TESTS") else ["integration_tests/multinode"]
)
