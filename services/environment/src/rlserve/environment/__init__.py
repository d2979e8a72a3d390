"""rlserve's environment service: the tools a multi-turn rollout calls, as a separately
deployable Serve gRPC app that scales on cheap nodes like the reward service.

Modules: `config` (the service's typed config, tools by name), `tools` (what a tool is,
the calculator, user tools by import path), `python_tool` and `sandbox` (model-written
Python run with no network, confined to a throw-away scratch directory, with bounded CPU,
memory, files, processes, output and wall time), `engine` (one call's checks, time limit
and failure rules; the sessions), `deployment` and `app` (the Serve app).
"""
