"""rlserve reference service: log-probs under the frozen initial policy (the KL anchor).

Skeleton: the service is built under the critic/reference/reward issue; its contract is
proto/rlserve/v1/reference.proto.
"""
