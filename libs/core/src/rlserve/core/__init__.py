"""rlserve core: what every service and the trainer share.

batch (the Batch container), codec (Batch/tensor <-> rlserve.v1 protobuf), algos
(pure PPO/GRPO math), config and run_config (typed, validated configuration), embedded
(the tiny model, tokenizer and arithmetic task that run with no download).
"""
