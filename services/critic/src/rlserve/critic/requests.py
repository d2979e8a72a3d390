"""Checks of ComputeValues / UpdateCritic batches, before any worker sees them.

Every failure is an RpcError naming the field (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED
for an oversized batch), so a bad request never reaches a model and the replica keeps
serving. The checks return a clean Batch holding only the tensors the workers use, ids
and masks as int64 and values/returns as float32.

The sequence layout checks (responses are the tail of input_ids, the response mask lies
inside the attention mask, at least one prompt position) are the ones every model service
needs; they belong in rlserve.core.validation once the lead moves them there.
"""

import torch

from rlserve.core.batch import Batch
from rlserve.core.serving import invalid_argument
from rlserve.core.validation import (
    require_finite,
    require_mask,
    require_rows,
    require_tensor,
    require_token_ids,
)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def sequence_batch(batch: Batch, vocab_size: int, max_rows: int) -> Batch:
    """input_ids, attention_mask [N, P+R], responses, response_mask [N, R], checked."""
    require_rows(batch, max_rows)
    input_ids = require_token_ids(batch, "input_ids", vocab_size)
    attention_mask = require_mask(batch, "attention_mask", input_ids, "input_ids")
    responses = require_token_ids(batch, "responses", vocab_size)
    response_mask = require_mask(batch, "response_mask", responses, "responses")
    response_len = responses.shape[1]
    if input_ids.shape[1] <= response_len:
        raise invalid_argument(
            "batch.tensors['input_ids']",
            f"needs more positions ({input_ids.shape[1]}) than responses ({response_len}): "
            "the first response token is predicted from the position before it",
        )
    tail = input_ids[:, input_ids.shape[1] - response_len :]
    if not bool(((tail == responses) | (response_mask == 0)).all()):
        raise invalid_argument(
            "batch.tensors['responses']",
            "must equal the last R columns of input_ids where response_mask is 1",
        )
    tail_mask = attention_mask[:, attention_mask.shape[1] - response_len :]
    if bool((response_mask > tail_mask).any()):
        raise invalid_argument(
            "batch.tensors['response_mask']",
            "marks positions that attention_mask (last R columns) masks out",
        )
    return Batch(
        tensors={
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "responses": responses,
            "response_mask": response_mask,
        },
        meta=batch.meta,
    )


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
    sequences = sequence_batch(batch, vocab_size, max_rows)
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
