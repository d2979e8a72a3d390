# Shared fixtures (one Ray + Serve per session, tiny models) for every package's tests.
pytest_plugins = ["rlserve.core.testing"]
