"""The ActorWorker methods the rollout's controller and deployment call, by name (see
rlserve.core.service.methods; a test checks each names an ActorWorker method). Light on
purpose: the controller imports it, never the worker module (transformers, DeepSpeed,
vLLM)."""

GENERATE = "generate"
GENERATE_TURNS = "generate_turns"
COMPUTE_LOG_PROB = "compute_log_prob"
COMPUTE_REF_LOG_PROB = "compute_ref_log_prob"
UPDATE_ACTOR = "update_actor"
MODEL_LIMITS = "model_limits"
