"""rlserve reward service: reward model, rule functions and external HTTP API scores.

Skeleton: the service is built under the critic/reference/reward issue; its contract is
proto/rlserve/v1/reward.proto.
"""
