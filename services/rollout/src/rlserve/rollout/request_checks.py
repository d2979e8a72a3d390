"""Checks of rollout requests, before any work: each failure names the field.

Built on rlserve.core.tensor_checks (ids within the vocabulary, masks shaped like their
ids and holding 0/1, finite floats) and rlserve.core.validation (row and token limits).
The rollout-specific rules on top:

- prompts are left-padded: each attention_mask row is zeros then ones, with at least
  one real token, so a prompt ends exactly where generation starts;
- a sequence batch is prompt ‖ response, checked by rlserve.core.tensor_checks'
  require_sequences (the one layout rule of every model service: responses [N, R] are
  the last R columns of input_ids wherever response_mask is 1, those positions are real
  tokens, and at least one prompt column precedes them); rows of an update have at
  least one response token;
- float inputs of an update (old_log_probs, advantages, ref_log_probs) are shaped like
  responses and finite everywhere.
"""

from __future__ import annotations

import math

import torch

from rlserve.core.batch import Batch
from rlserve.core.serving import invalid_argument, resource_exhausted
from rlserve.core.tensor_checks import (
    require_finite,
    require_mask,
    require_sequences,
    require_tensor,
    require_token_ids,
)
from rlserve.core.validation import require_rows, require_tokens
from rlserve.rollout.generation import SamplingSettings

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sampling(
    sampling: SamplingSettings,
    max_new_tokens_limit: int,
    field: str = "sampling",
) -> None:
    """Ranges of the sampling parameters (already normalised: top_k -1 = off, n >= 1)."""
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise invalid_argument(
            f"{field}.temperature", f"must be >= 0 (0 = greedy), got {sampling.temperature}"
        )
    if not 0 < sampling.top_p <= 1:
        raise invalid_argument(f"{field}.top_p", f"must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k != -1 and sampling.top_k < 1:
        raise invalid_argument(
            f"{field}.top_k", f"must be >= 1, or 0/-1 for off; got {sampling.top_k}"
        )
    if sampling.max_new_tokens < 1:
        raise invalid_argument(
            f"{field}.max_new_tokens", f"must be >= 1, got {sampling.max_new_tokens}"
        )
    if sampling.max_new_tokens > max_new_tokens_limit:
        raise resource_exhausted(
            f"{field}.max_new_tokens",
            f"{sampling.max_new_tokens} exceeds this service's limit of {max_new_tokens_limit}",
        )
    if sampling.responses_per_prompt < 1:
        raise invalid_argument(
            f"{field}.responses_per_prompt",
            f"must be >= 1 (0 is read as 1), got {sampling.responses_per_prompt}",
        )


def check_prompts(
    prompts: Batch,
    vocab_size: int,
    max_positions: int,
    max_new_tokens: int,
    responses_per_prompt: int,
    max_batch_samples: int,
    max_request_tokens: int | None = None,
    field: str = "prompts",
) -> Batch:
    """Left-padded prompts; returns them with int64 input_ids / attention_mask.

    The batch the request makes, prompts × responses_per_prompt rows of (prompt columns
    + max_new_tokens) positions, must fit max_batch_samples rows and max_request_tokens
    positions: a request of a few bytes can otherwise ask for gigabytes of KV cache.
    """
    require_rows(prompts, max_batch_samples, field)
    samples = len(prompts) * responses_per_prompt
    if samples > max_batch_samples:
        raise resource_exhausted(
            f"{field}, sampling.responses_per_prompt",
            f"{len(prompts)} prompts × {responses_per_prompt} responses exceed this "
            f"service's limit of {max_batch_samples} samples per request; split it",
        )
    input_ids = require_token_ids(prompts, "input_ids", vocab_size, field)
    columns = input_ids.shape[1]
    require_tokens(
        samples * (columns + max_new_tokens),
        max_request_tokens,
        f"{field}, sampling.responses_per_prompt, sampling.max_new_tokens",
        f"{len(prompts)} prompts × {responses_per_prompt} responses × ({columns} prompt "
        f"columns + {max_new_tokens} new tokens)",
    )
    mask = require_mask(prompts, "attention_mask", input_ids, "input_ids", field)
    mask_name = f"{field}.tensors['attention_mask']"
    # Left padding: once a row turns 1 it stays 1, i.e. the mask never decreases.
    drops = (mask[:, 1:] < mask[:, :-1]).any(dim=1)
    if bool(drops.any()):
        raise invalid_argument(
            mask_name,
            f"row {int(drops.nonzero()[0])} is not left-padded "
            "(zeros, then ones up to the last column)",
        )
    if mask.shape[1] == 0 or not bool(mask[:, -1].all()):
        raise invalid_argument(mask_name, "every prompt needs at least one real token (1)")
    longest = int(mask.sum(dim=1).max())
    if longest + max_new_tokens > max_positions:
        raise invalid_argument(
            f"{field}.tensors['input_ids']",
            f"a prompt of {longest} tokens + sampling.max_new_tokens {max_new_tokens} exceeds "
            f"the model's {max_positions} positions",
        )
    return _with_tensors(prompts, input_ids=input_ids, attention_mask=mask)


def check_sequences(
    batch: Batch,
    vocab_size: int,
    max_batch_samples: int,
    max_request_tokens: int | None = None,
    field: str = "batch",
) -> Batch:
    """prompt ‖ response sequences (rlserve.core.tensor_checks.require_sequences, the rule
    critic and reference apply too); returns the batch with int64 ids and masks."""
    sequences = require_sequences(batch, vocab_size, max_batch_samples, field, max_request_tokens)
    return _with_tensors(batch, **sequences.tensors)


def check_update_batch(
    batch: Batch,
    vocab_size: int,
    max_batch_samples: int,
    need_ref_log_probs: bool,
    max_request_tokens: int | None = None,
    field: str = "batch",
) -> Batch:
    """Sequences plus advantages, old_log_probs when sent (the controller decides
    whether it may be left out) and ref_log_probs when needed, as float32."""
    batch = check_sequences(batch, vocab_size, max_batch_samples, max_request_tokens, field)
    responses, response_mask = batch["responses"], batch["response_mask"]
    if not bool(response_mask.any(dim=1).all()):
        row = int((~response_mask.any(dim=1)).nonzero()[0])
        raise invalid_argument(
            f"{field}.tensors['response_mask']",
            f"row {row} has no response token; every trained row needs at least one",
        )
    keys = ["advantages"] + (["ref_log_probs"] if need_ref_log_probs else [])
    if "old_log_probs" in batch.tensors:
        keys.append("old_log_probs")
    floats = {}
    for key in keys:
        values = require_tensor(batch, key, FLOAT_DTYPES, 2, field)
        if values.shape != responses.shape:
            raise invalid_argument(
                f"{field}.tensors[{key!r}]",
                f"shape {list(values.shape)} must match responses {list(responses.shape)}",
            )
        floats[key] = require_finite(values, key, field).float()
    return _with_tensors(batch, **floats)


def check_update_rows(batch: Batch, workers: int, mini_batch_samples: int, epochs: int) -> None:
    """An update's rows split evenly over the workers and tile the mini-batches, and
    leave old_log_probs out only for a single optimizer step."""
    rows, mini = len(batch), mini_batch_samples
    if rows % workers:
        raise invalid_argument("batch", f"{rows} rows must be a multiple of the {workers} workers")
    if rows % mini:
        raise invalid_argument(
            "batch",
            f"{rows} rows must be a multiple of ppo_mini_batch_samples {mini} "
            f"(split over {workers} workers)",
        )
    if "old_log_probs" not in batch.tensors and (epochs > 1 or rows > mini):
        raise invalid_argument(
            "batch.tensors['old_log_probs']",
            f"may be left out only when the update is one optimizer step (ppo_epochs 1, "
            f"rows = ppo_mini_batch_samples {mini}), as then the update's own forward "
            f"is the behaviour policy; this update has {epochs} epoch(s) "
            f"over {rows} rows: send ComputeLogProb's log_probs",
        )


def _with_tensors(batch: Batch, **tensors: torch.Tensor) -> Batch:
    return Batch({**batch.tensors, **tensors}, batch.non_tensors, batch.meta)
