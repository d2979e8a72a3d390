"""rlserve's environment service: the tools and simulated users a multi-turn rollout
talks to, as a separately deployable Serve gRPC app that scales on cheap nodes like the
reward service.

Modules: `sandbox` (a Python executor confined to a throw-away scratch directory, with
no network and bounded CPU, memory, files, processes, output and wall time).
"""
