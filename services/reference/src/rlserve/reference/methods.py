"""The ReferenceWorker methods the reference's controller calls, by name (see
rlserve.core.service.methods; a test checks each names a ReferenceWorker method). Light
on purpose: the controller imports it, never the worker module (transformers)."""

COMPUTE_REF_LOG_PROB = "compute_ref_log_prob"
