"""rlserve rollout service (ActorRollout): generation engines and DeepSpeed actor training.

Skeleton: the service is built under the rollout issue; its contract is
proto/rlserve/v1/rollout.proto.
"""
