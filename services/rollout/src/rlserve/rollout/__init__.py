"""rlserve rollout service (ActorRollout): generation engines and DeepSpeed actor training.

Contract: proto/rlserve/v1/rollout.proto. Deploy with the Serve app builder
`rlserve.rollout.app:build_app` (settings: `config.RolloutServiceConfig`).

Modules: `config` (typed settings), `deployment` (thin gRPC servicer on Serve), `engine`
(RolloutController: versions, idempotent updates, DP dispatch), `request_checks`
(request validation), `worker` (ActorWorker: one DeepSpeed rank + generation engine),
`generation` (the engine interface), `hf_engine` / `vllm_engine` (the two engines).
"""
