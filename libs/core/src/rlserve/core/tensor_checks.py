"""Request checks of a batch's tensors: dtypes, ranks, token ids, masks, and the
prompt ‖ response layout every model service reads. Each failure names the field and
the fix (INVALID_ARGUMENT / RESOURCE_EXHAUSTED, as in rlserve.core.validation).
"""

import torch

from rlserve.core.batch import Batch
from rlserve.core.serving import invalid_argument
from rlserve.core.validation import require_rows, require_tokens

_ID_DTYPES = (torch.int64, torch.int32)


def require_tensor(
    batch: Batch,
    key: str,
    dtypes: tuple[torch.dtype, ...],
    ndim: int,
    field: str = "batch",
) -> torch.Tensor:
    """The tensor `key`, checked for presence, dtype and rank."""
    name = f"{field}.tensors[{key!r}]"
    if key not in batch.tensors:
        raise invalid_argument(name, f"missing; this call needs it (has {sorted(batch.tensors)})")
    tensor = batch.tensors[key]
    if tensor.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise invalid_argument(name, f"dtype must be {allowed}, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise invalid_argument(name, f"must have {ndim} dims, got shape {list(tensor.shape)}")
    return tensor


def require_token_ids(
    batch: Batch, key: str, vocab_size: int, field: str = "batch"
) -> torch.Tensor:
    """An int tensor [B, S] of ids in 0..vocab_size-1, returned as int64."""
    ids = require_tensor(batch, key, _ID_DTYPES, 2, field)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise invalid_argument(
            f"{field}.tensors[{key!r}]",
            f"token ids must lie in 0..{vocab_size - 1}, got {int(ids.min())}..{int(ids.max())}",
        )
    return ids.long()


def require_mask(
    batch: Batch, key: str, like: torch.Tensor, like_key: str, field: str = "batch"
) -> torch.Tensor:
    """A 0/1 mask with the shape of `like`, returned as int64."""
    mask = require_tensor(batch, key, (*_ID_DTYPES, torch.bool), 2, field)
    name = f"{field}.tensors[{key!r}]"
    if mask.shape != like.shape:
        raise invalid_argument(
            name, f"shape {list(mask.shape)} must match {like_key} {list(like.shape)}"
        )
    if mask.dtype != torch.bool and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise invalid_argument(name, "must hold only 0 and 1")
    return mask.long()


def require_finite(tensor: torch.Tensor, name: str, field: str = "batch") -> torch.Tensor:
    """A float tensor with no NaN or infinity."""
    if not tensor.is_floating_point():
        raise invalid_argument(f"{field}.tensors[{name!r}]", f"must be float, got {tensor.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise invalid_argument(
            f"{field}.tensors[{name!r}]", f"{bad} values are NaN or infinite; all must be finite"
        )
    return tensor


def require_sequences(
    batch: Batch,
    vocab_size: int,
    max_rows: int,
    field: str = "batch",
    max_tokens: int | None = None,
) -> Batch:
    """input_ids, attention_mask [N, P+R], responses, response_mask [N, R], checked.

    The one sequence-layout rule every model service applies (rollout, critic,
    reference): responses are the last R columns of input_ids wherever response_mask is
    1, those positions are real tokens (attention_mask 1), and a prompt precedes them:
    at least one prompt column (P >= 1: the first response token is predicted from the
    position before it), with a real token in every row that has a response token, and
    a real token right before every response token (prompts left-padded).
    At most `max_tokens` positions N × (P+R) (require_tokens). Returns only these four
    tensors (ids and masks as int64) with the batch's meta.
    """
    require_rows(batch, max_rows, field)
    input_ids = require_tensor(batch, "input_ids", _ID_DTYPES, 2, field)
    rows, columns = input_ids.shape
    require_tokens(
        rows * columns, max_tokens, f"{field}.tensors['input_ids']", f"{rows} rows × {columns}"
    )
    input_ids = require_token_ids(batch, "input_ids", vocab_size, field)
    attention_mask = require_mask(batch, "attention_mask", input_ids, "input_ids", field)
    responses = require_token_ids(batch, "responses", vocab_size, field)
    response_mask = require_mask(batch, "response_mask", responses, "responses", field)
    response_len = responses.shape[1]
    if input_ids.shape[1] <= response_len:
        raise invalid_argument(
            f"{field}.tensors['input_ids']",
            f"needs more positions ({input_ids.shape[1]}) than responses ({response_len}): "
            "the first response token is predicted from the position before it, so send "
            "input_ids = prompt ‖ response with at least one prompt column",
        )
    prompt_len = input_ids.shape[1] - response_len
    tail = input_ids[:, prompt_len:]
    if not bool(((tail == responses) | (response_mask == 0)).all()):
        raise invalid_argument(
            f"{field}.tensors['responses']",
            "must equal the last R columns of input_ids where response_mask is 1",
        )
    tail_mask = attention_mask[:, prompt_len:]
    if bool((response_mask > tail_mask).any()):
        raise invalid_argument(
            f"{field}.tensors['response_mask']",
            "marks positions that attention_mask (last R columns) masks out",
        )
    no_prompt = response_mask.bool().any(dim=1) & ~attention_mask[:, :prompt_len].bool().any(dim=1)
    if bool(no_prompt.any()):
        raise invalid_argument(
            f"{field}.tensors['attention_mask']",
            f"row {int(no_prompt.nonzero()[0])} has response tokens but no real prompt token "
            f"(0 in all {prompt_len} prompt columns); a response is scored after its prompt",
        )
    # Each response token's log-prob (and value) is read at the position before it, which
    # must be a real token: a masked one there (a right-padded prompt, a gap inside the
    # response) would score the token from a padding position.
    before = attention_mask[:, prompt_len - 1 : -1].bool()
    after_padding = response_mask.bool() & ~before
    if bool(after_padding.any()):
        row, column = (int(i) for i in after_padding.nonzero()[0])
        raise invalid_argument(
            f"{field}.tensors['attention_mask']",
            f"row {row}: response token {column} follows a masked position (input_ids column "
            f"{prompt_len + column - 1}); each response token is scored from the real token "
            "before it: left-pad prompts, right-pad responses",
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
