# Shared fixtures (one Ray + Serve per session, tiny models) for every package's tests.
import os

import pytest

pytest_plugins = ["rlserve.core.testing"]

# The multi-node tests run their own simulated cluster, and a process holds one Ray: they
# are a second pytest session (`make test` runs both; see integration_tests/multinode).
# The two-node tests start a cluster in network namespaces (root only): a third session.
collect_ignore = [
    *([] if os.environ.get("RLSERVE_MULTINODE_TESTS") else ["integration_tests/multinode"]),
    *([] if os.environ.get("RLSERVE_NETNS_TESTS") else ["integration_tests/netns"]),
]


def pytest_collection_modifyitems(config, items):
    """Marks `cluster` every test that uses the session's Ray cluster (the serve_cluster
    fixture, directly or through another fixture): `make test-fast` leaves them out."""
    for item in items:
        if "serve_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
