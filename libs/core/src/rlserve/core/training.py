"""DeepSpeed training engines for the actor and the critic, and their checkpoints.

Choices: the optimizer is torch's AdamW handed to DeepSpeed (its CPU/fused Adam would
JIT-compile C++ for ≈ 35 s on first use and buys nothing at this size), torch's fused
kernel on CUDA and its per-tensor loop on the CPU (`adamw`); ZeRO stage,
gradient clipping and accumulation come from DeepSpeed's config; gloo is the backend on
CPU. DeepSpeed scales each micro-batch loss by 1/gradient_accumulation_steps in
`backward` and only steps the optimizer at accumulation boundaries, so callers call
`backward` + `step` once per micro-batch.

Checkpoints hold two things: DeepSpeed's own (weights + optimizer + scheduler, for
resume, written by every rank) and the weights in HF format as safetensors (for users,
written by rank 0 from a gathered state dict, ZeRO-3 included).

Loading never unpickles code. DeepSpeed's own loader is `torch.load(weights_only=False)`:
a crafted `*.pt` file under a checkpoint ran a caller's code in the workers. Here every
file DeepSpeed reads goes through `torch.load(weights_only=True)` (tensors, containers,
numbers, strings, plus the four plain DeepSpeed classes its optimizer states hold:
SAFE_DEEPSPEED_GLOBALS), first in `check_training_checkpoint` — every rank reads its
files before any rank changes a weight, so a refused or corrupt file leaves the service
as it was — and again in the load itself.
"""

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlserve.core.inputs_config import LARGE_MODEL_WEIGHT_BYTES

# Not "latest": DeepSpeed writes a file of that name holding the newest tag.
DS_CHECKPOINT_TAG = "state"
DEEPSPEED_SUBDIR = "deepspeed"
"""Where a service checkpoint keeps DeepSpeed's state (beside its HF-format model)."""


@dataclass(frozen=True)
class OptimizerSettings:
    """How a DeepSpeed engine trains one rank's model (built from a service config)."""

    lr: float
    weight_decay: float
    zero_stage: int
    grad_clip: float
    micro_batch_samples: int
    """Rows per forward/backward pass."""
    grad_accum_steps: int
    """Micro-batches per optimizer step on this rank."""


def deepspeed_config(
    zero_stage: int,
    micro_batch_samples: int,
    grad_accum_steps: int,
    grad_clip: float,
    dtype: str = "float32",
) -> dict[str, Any]:
    """DeepSpeed's config dict; batch sizes are per rank. `dtype` is the model's
    parameter dtype: bfloat16 or float16 turns on DeepSpeed's mixed precision (float32
    master weights and optimizer state)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage: must be 0, 1, 2 or 3, got {zero_stage}")
    if dtype not in ("float32", "bfloat16", "float16"):
        # A stray 'auto' here would train in float32 whatever the weights are.
        raise ValueError(
            f"dtype: must be float32, bfloat16 or float16, got {dtype!r}; resolve 'auto' "
            "for the device first (rlserve.core.modeling.resolve_dtype)"
        )
    return {
        "train_micro_batch_size_per_gpu": micro_batch_samples,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }


def build_training_engine(
    model: torch.nn.Module, optimizer: OptimizerSettings, dtype: str = "float32"
) -> Any:
    """Wraps `model` in a DeepSpeed engine with AdamW; the process group must exist.
    `dtype`: the model's parameter dtype (deepspeed_config)."""
    import deepspeed

    trained = [p for p in model.parameters() if p.requires_grad]
    config = deepspeed_config(
        optimizer.zero_stage,
        optimizer.micro_batch_samples,
        optimizer.grad_accum_steps,
        optimizer.grad_clip,
        dtype,
    )
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=adamw(trained, optimizer), config=config
    )
    if optimizer.zero_stage == 0:
        _bound_allreduce_memory(engine)
    return engine


def adamw(parameters: list[torch.nn.Parameter], optimizer: OptimizerSettings) -> torch.optim.AdamW:
    """torch's AdamW for `parameters`: the fused kernel on CUDA, and on the CPU once the
    trained weights reach LARGE_MODEL_WEIGHT_BYTES; the per-tensor loop below that.

    Fused, on CUDA a few launches per step instead of several per tensor; on the CPU one
    pass over each tensor and no temporaries: SmolLM2-135M's full weights step in 0.072 s
    on 2 cores against 0.364 s for the loop and 0.358 s for the multi-tensor (foreach)
    version, which also holds ~300 MiB of temporaries (benchmarks/bench_optimizer_step.py).
    Small models keep the loop: their step takes milliseconds either way, and the fused
    kernel rounds differently, which moves the embedded default's learning curves
    (seeds 0-2: +29.4, +21.2, +21.2 points against the loop's +30.8, +12.8, +30.2).
    """
    trained_bytes = sum(p.numel() * p.element_size() for p in parameters)
    on_cuda = any(p.device.type == "cuda" for p in parameters)
    kernel = (
        {"fused": True}
        if on_cuda or trained_bytes >= LARGE_MODEL_WEIGHT_BYTES
        else {"foreach": False}
    )
    return torch.optim.AdamW(
        parameters, lr=optimizer.lr, weight_decay=optimizer.weight_decay, **kernel
    )


# Elements per gradient all-reduce bucket under ZeRO-0 (100 MB of float32).
ALLREDUCE_BUCKET_ELEMENTS = 25_000_000


def _bound_allreduce_memory(engine: Any) -> None:
    """ZeRO-0's all-reduce flattens the gradients into buckets of 5e8 elements, so a
    model under 2 GB of gradients gets one flat copy of all of them at every optimizer
    step (0.54 GB for a 135 M model), even with one rank. One rank with float32
    gradient communication: skip the reduction, a provable no-op there (the sum over
    one rank, divided by a world size of 1). Otherwise smaller buckets: with bf16 or
    fp16 DeepSpeed reduces in that dtype, rounding the gradients even at one rank, so
    skipping it would train differently from several ranks; a one-GPU run then
    exercises the NCCL all-reduce that several ranks use."""
    import torch.distributed as dist

    if dist.get_world_size() == 1 and engine.communication_data_type == torch.float32:
        engine.enable_backward_allreduce = False
        return
    reduce = engine.allreduce_gradients
    engine.allreduce_gradients = lambda bucket_size=None: reduce(
        bucket_size=ALLREDUCE_BUCKET_ELEMENTS
    )


def grad_norm(engine: Any) -> float:
    """Global gradient norm (before clipping) of the micro-batches accumulated so far.

    Call it before the `engine.step()` that ends an accumulation: under ZeRO-0 with a
    client optimizer DeepSpeed records no norm and that step frees the gradients.
    """
    norm = engine.get_global_grad_norm()
    if norm is None:  # ZeRO-0 with a client optimizer does not record it
        squares = [
            p.grad.detach().float().pow(2).sum()
            for p in engine.module.parameters()
            if p.grad is not None
        ]
        norm = torch.stack(squares).sum().sqrt() if squares else torch.tensor(0.0)
    return float(norm)


def live_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The unsharded weights with no copy where they are whole already: under ZeRO 0-2
    the training module's own parameters (detached; the next optimizer step changes
    them, so take full_state_dict to keep them), under ZeRO-3 a gathered copy (a
    collective: call on all ranks)."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict()


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """A snapshot of the unsharded weights on every rank, unchanged by later training
    (a collective under ZeRO-3: call on all ranks)."""
    if engine.zero_optimization_stage() == 3:
        return live_state_dict(engine)  # gathered: a copy already
    return {k: v.clone() for k, v in live_state_dict(engine).items()}


def save_training_checkpoint(engine: Any, directory: Path, client_state: dict) -> None:
    """DeepSpeed checkpoint (weights, optimizer, client_state); call on every rank."""
    engine.save_checkpoint(str(directory), tag=DS_CHECKPOINT_TAG, client_state=client_state)


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that weights-only loading refuses: it holds code to run (a
    pickle payload), an object of an unexpected class, or is corrupt."""


SAFE_DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""Classes DeepSpeed 0.19's optimizer states pickle (ZeRO 1-3, fp32/bf16/fp16): a loss
scaler (plain attributes), an int enum and a named tuple. Weights-only loading may
build exactly these besides torch's own tensor types; everything else is refused."""
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")


def weights_only_load(path: str | Path, map_location: Any = "cpu") -> Any:
    """torch.load that builds tensors and plain data only (never runs pickled code).

    Raises:
        UnsafeCheckpointError: naming the file and torch's reason.
    """
    import importlib

    allowed = []
    for name in SAFE_DEEPSPEED_GLOBALS:
        module, _, attribute = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attribute))
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:
        reason = " ".join(str(error).split())[:300]
        raise UnsafeCheckpointError(f"{path}: refused by weights-only loading ({reason})") from None


def check_training_checkpoint(
    directory: Path, rank: int, client_keys: Sequence[str] = ()
) -> dict[str, Any]:
    """Reads every state file of `directory`'s DeepSpeed checkpoint that `rank` loads
    (the model states, and the ZeRO partitions of this rank) with weights_only_load,
    changing nothing: call on every rank before load_training_checkpoint. Returns the
    entries named `client_keys` of the saved client_state (DeepSpeed keeps it beside
    the weights in the model-states file), so a caller can check them before loading;
    absent ones are left out.

    Raises:
        FileNotFoundError: no DeepSpeed checkpoint there.
        UnsafeCheckpointError: a file would run code, holds another class, or is corrupt.
    """
    tag_dir = Path(directory) / DS_CHECKPOINT_TAG
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}")
    files = sorted(tag_dir.glob("*.pt"))
    if not files:
        raise FileNotFoundError(f"no DeepSpeed state files under {tag_dir}")
    client_state = {}
    for path in files:
        owner = _RANK_FILE.search(path.name)
        if owner is None or int(owner.group(1)) == rank:
            content = weights_only_load(path)
            if isinstance(content, dict):  # the model states (per rank under ZeRO-3)
                client_state.update({key: content[key] for key in client_keys if key in content})
    return client_state


def load_training_checkpoint(engine: Any, directory: Path) -> dict:
    """Restores what save_training_checkpoint wrote; returns its client_state.

    Every file goes through weights_only_load (DeepSpeed's own loader unpickles). Call
    check_training_checkpoint on every rank first: a refused file raises here only
    after some state may have changed.
    """
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            return weights_only_load(path, map_location)

    # DeepSpeed asserts deep inside on a missing checkpoint; say what is missing instead.
    if not (Path(directory) / DS_CHECKPOINT_TAG).is_dir():
        raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}")
    own_engine = engine.checkpoint_engine
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine()
    try:
        path, client_state = engine.load_checkpoint(
            str(directory), tag=DS_CHECKPOINT_TAG, load_optimizer_states=True
        )
    finally:
        engine.checkpoint_engine = own_engine
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}")
    return client_state


def minibatch_indices(
    num_samples: int, mini_batch_samples: int, epochs: int, seed: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(epoch, row indices) per mini-batch: a fresh permutation each epoch.

    num_samples must be a multiple of mini_batch_samples (callers validate it with a
    field-naming error before training starts).
    """
    generator = random.Random(seed)
    for epoch in range(epochs):
        order = list(range(num_samples))
        generator.shuffle(order)
        for start in range(0, num_samples, mini_batch_samples):
            yield epoch, torch.tensor(order[start : start + mini_batch_samples])
