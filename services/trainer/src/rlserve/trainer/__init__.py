"""rlserve trainer: the thin PPO controller composing the services over gRPC.

Skeleton: the trainer is built under the trainer issue; its control contract is
proto/rlserve/v1/trainer.proto.
"""
