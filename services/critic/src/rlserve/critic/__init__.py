"""rlserve critic service: per-token values and clipped value-loss training.

Contract: proto/rlserve/v1/critic.proto. Modules: `config` (CriticServiceConfig),
`model` (value model = causal-LM backbone + zero-initialised scalar head, HF export),
`worker` (one DeepSpeed rank), `controller` (checks, idempotent updates, DP dispatch),
`deployment` (the Serve gRPC deployment), `app` (`build_app`, the import_path target).
"""
