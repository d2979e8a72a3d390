"""rlserve reward service: reward model, rule functions and external HTTP API scores.

Stateless and horizontally scalable; contract in proto/rlserve/v1/reward.proto. Public
surface:

- `rlserve.reward.app:build_app` — Serve app builder (import_path for Serve configs);
- `rlserve.reward.config.RewardServiceConfig` — the one typed config;
- `rlserve.reward.engine` — `build_engine`, `RewardEngine` (testable without Ray/gRPC);
- `rlserve.reward.rules` — `register_rule`, `resolve_rule`, the shipped rules;
- `rlserve.reward.http_client.HttpScoreClient` — the pooled, retrying HTTP client.
"""
