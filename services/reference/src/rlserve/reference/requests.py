"""Checks of a ComputeRefLogProb batch, before any worker sees it.

Every failure is an RpcError naming the field (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED
for an oversized batch), so a bad request never reaches the model and the replica keeps
serving. The result holds only the tensors the workers use, ids and masks as int64.

The same sequence-layout checks guard the critic; they belong in rlserve.core.validation
once the lead moves them there (services may not import each other).
"""

from rlserve.core.batch import Batch
from rlserve.core.serving import invalid_argument
from rlserve.core.validation import require_mask, require_rows, require_token_ids


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
