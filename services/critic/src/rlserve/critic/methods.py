"""The CriticWorker methods the critic's controller calls, by name (see
rlserve.core.service.methods; a test checks each names a CriticWorker method). Light on
purpose: the controller imports it, never the worker module (transformers)."""

COMPUTE_VALUES = "compute_values"
UPDATE_CRITIC = "update_critic"
