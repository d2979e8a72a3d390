"""rlserve core: what every service and the trainer share.

batch (the Batch container), codec (Batch/tensor <-> rlserve.v1 protobuf), algos
(pure PPO/GRPO math), config and run_config (typed, validated configuration; the
sections a service shares or that stand on their own in worker_settings, reward_settings,
inputs_config, placement_config, tracing_config and vllm_config), embedded (the tiny
model, tokenizer and arithmetic task that run with no download).
"""
