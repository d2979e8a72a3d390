"""Checks of ComputeValues / UpdateCritic batches, before any worker sees them.

Every failure is an RpcError naming the field (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED
for an oversized batch), so a bad request never reaches a model and the replica keeps
serving. The checks return a clean Batch holding only the tensors the workers use, ids
and masks as int64 and values/returns as float32.

The sequence layout checks are rlserve.core.validation.require_sequences, shared with
the reference service.
"""

import torch

from rlserve.core.batch import Batch
from rlserve.core.serving import invalid_argument
from rlserve.core.validation import require_finite, require_sequences, require_tensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _response_floats(batch: Batch, key: str, like: torch.Tensor) -> torch.Tensor:
    tensor = require_tensor(batch, key, _FLOATS, 2)
    if tensor.shape != like.shape:
        raise invalid_argument(
            f"batch.tensors[{key!r}]",
            f"shape {list(tensor.shape)} must match responses {list(like.shape)}",
        )
    return require_finite(tensor, key).float()


def update_batch(batch: Batch, vocab_size: int, max_rows: int, mini_batch_samples: int) -> Batch:
    """A sequence batch plus values and returns [N, R]; rows tile the mini-batches."""
    sequences = require_sequences(batch, vocab_size, max_rows)
    rows = len(sequences)
    if rows % mini_batch_samples:
        raise invalid_argument(
            "batch",
            f"{rows} rows are not a multiple of this critic's ppo_mini_batch_samples "
            f"({mini_batch_samples}); send whole mini-batches",
        )
    response_mask = sequences.tensors["response_mask"]
    if not bool(response_mask.any()):
        raise invalid_argument("batch.tensors['response_mask']", "has no response token")
    like = sequences.tensors["responses"]
    extra = {key: _response_floats(batch, key, like) for key in ("values", "returns")}
    return Batch(tensors={**sequences.tensors, **extra}, meta=sequences.meta)
