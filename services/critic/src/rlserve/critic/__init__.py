"""rlserve critic service: value estimates and clipped value-loss training.

Skeleton: the service is built under the critic/reference/reward issue; its contract is
proto/rlserve/v1/critic.proto.
"""
