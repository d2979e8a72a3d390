"""Request checks every service shares; each failure names the field and the fix.

These read a batch's size, columns and meta, so they need no torch (a rule reward's
replica may have none); the checks of its tensors are rlserve.core.tensor_checks.

They raise `RpcError`s (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) that `rpc_method` turns
into gRPC statuses, so a bad request never reaches a model and the replica keeps serving.
"""

import math
from typing import Any, Protocol

from rlserve.core.serving import invalid_argument, resource_exhausted


class Rows(Protocol):
    """What these checks read: a Batch, or a wire.BatchColumns decoded without torch."""

    non_tensors: dict[str, list[Any]]
    meta: dict[str, Any]

    def __len__(self) -> int: ...


TEMPERATURE_META_KEY = "temperature"
"""Batch meta key the rollout's GenerateSequences stamps with its sampling temperature."""


def require_rows(batch: Rows, max_rows: int, field: str = "batch") -> None:
    """A non-empty batch of at most max_rows rows."""
    if len(batch) == 0:
        raise invalid_argument(field, "empty batch; send at least one row")
    if len(batch) > max_rows:
        raise resource_exhausted(
            field, f"{len(batch)} rows exceed this service's limit of {max_rows}; split it"
        )


def require_tokens(tokens: int, max_tokens: int | None, field: str, counted: str) -> None:
    """At most max_tokens token positions (rows × sequence length) of work in one request
    (None = no limit); `counted` says how the request's count was made.

    The service's `max_request_tokens` setting: a small request can otherwise ask a
    replica for more memory (KV cache, activations, the answer's tensors) and time than
    it has.
    """
    if max_tokens is not None and tokens > max_tokens:
        raise resource_exhausted(
            field,
            f"{counted} = {tokens:,} token positions exceed this service's limit of "
            f"{max_tokens:,} (its max_request_tokens setting); split the request, or raise "
            "max_request_tokens where the replica has the memory",
        )


def require_non_tensor(batch: Rows, key: str, field: str = "batch") -> list:
    if key not in batch.non_tensors:
        raise invalid_argument(
            f"{field}.non_tensors[{key!r}]",
            f"missing; this call needs it (has {sorted(batch.non_tensors)})",
        )
    return batch.non_tensors[key]


def scoring_temperature(batch: Rows, default: float) -> float:
    """The temperature to score a batch's tokens at: its meta's sampling temperature
    (stamped by GenerateSequences) or, without one, the service's configured `default`;
    0 (greedy sampling) scores at 1, as sampling's logits were never divided."""
    value = batch.meta.get(TEMPERATURE_META_KEY, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise invalid_argument(
            f"batch.meta[{TEMPERATURE_META_KEY!r}]",
            f"must be a finite number >= 0 (the sampling temperature), got {value!r}",
        )
    return float(value) if value > 0 else 1.0
