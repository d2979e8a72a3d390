"""Checks of ComputeValues / UpdateCritic batches, before any worker sees them, and
the value loss's knobs each rank gets (ValueLossSettings). What a rank trains on in an
update (RankUpdate, MiniBatchSlice, loss_units) is rlserve.core.service.plan's, the one
mini-batch plan of the actor and the critic, and is re-exported here.

Every failure is an RpcError naming the field (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED
for an oversized batch), so a bad request never reaches a model and the replica keeps
serving. The checks return a clean Batch holding only the tensors the workers use, ids
and masks as int64 and values/returns as float32.

The sequence layout checks are rlserve.core.tensor_checks.require_sequences, shared with
the reference service.
"""

from dataclasses import dataclass

import torch

from rlserve.core.batch import Batch
from rlserve.core.service.plan import MiniBatchSlice as MiniBatchSlice
from rlserve.core.service.plan import RankUpdate as RankUpdate
from rlserve.core.service.plan import loss_units as loss_units
from rlserve.core.serving import invalid_argument
from rlserve.core.tensor_checks import require_finite, require_sequences, require_tensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ValueLossSettings:
    """The clipped value loss's knobs (rlserve.core.algos.value.value_loss), per worker."""

    cliprange_value: float
    loss_agg_mode: str


def _response_floats(batch: Batch, key: str, like: torch.Tensor) -> torch.Tensor:
    tensor = require_tensor(batch, key, _FLOATS, 2)
    if tensor.shape != like.shape:
        raise invalid_argument(
            f"batch.tensors[{key!r}]",
            f"shape {list(tensor.shape)} must match responses {list(like.shape)}",
        )
    return require_finite(tensor, key).float()


def update_batch(
    batch: Batch,
    vocab_size: int,
    max_rows: int,
    mini_batch_samples: int,
    max_tokens: int | None = None,
) -> Batch:
    """A sequence batch plus values and returns [N, R]; rows tile the mini-batches."""
    sequences = require_sequences(batch, vocab_size, max_rows, max_tokens=max_tokens)
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
