"""Which training steps a stateful service has applied: the one rule for update steps.

An update RPC (UpdateActor, UpdateCritic) carries the trainer's step number. A service
accepts exactly two kinds of step:

- **the next step**, last applied + 1 (0 for a service that applied none): the update
  runs, and `record` stores its result;
- **a replay** of an applied step whose result is still kept (the last `keep`), sent
  with the very batch that step applied (`batch_fingerprint`): the stored result is
  answered and nothing trains, so a caller's retry is never applied twice.

Anything else is FAILED_PRECONDITION naming the expected step: a step that skips ahead
(one call with step 2^63-1 would otherwise make every later real step "old"), an old
step whose result is no longer kept, and an applied step sent with another batch (a
second trainer, or anyone holding the token, got there first: answering it "replayed"
would let the run go on from a batch it never sent). A negative step is INVALID_ARGUMENT.

The ledger is plain data (no locking, no I/O): each controller calls it under its own
lock, and saves `entries()` with its checkpoints so a restored service replays the same
steps. Results are whatever the service stores (metrics, the version after the step...)
and must be JSON-like to go into a checkpoint.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Generic, TypeVar

import torch

from rlserve.core.batch import Batch
from rlserve.core.serving import failed_precondition, invalid_argument

R = TypeVar("R")


def batch_fingerprint(batch: Batch) -> str:
    """sha256 of a batch's tensors (name, dtype, shape, bytes) and non-tensors; meta ignored.
    Hashes the tensors' own memory (a buffer view), never a copy of it."""
    digest = hashlib.sha256()
    for key in sorted(batch.tensors):
        tensor = batch.tensors[key].detach().to("cpu").contiguous()
        digest.update(f"{key}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        if tensor.numel():
            digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    for key in sorted(batch.non_tensors):
        digest.update(f"{key}|{batch.non_tensors[key]!r}|".encode())
    return digest.hexdigest()


class StepLedger(Generic[R]):
    """Applied steps, with the fingerprint of the batch each applied, and the kept
    results of the latest ones.

    Args:
        keep: how many most recent applied steps stay replayable (>= 1).
    """

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.last_applied_step = -1
        self._results: OrderedDict[int, tuple[str, R]] = OrderedDict()

    @property
    def expected_step(self) -> int:
        """The only new step this service accepts."""
        return self.last_applied_step + 1

    def replay_or_require_next(self, step: int, fingerprint: str, field: str = "step") -> R | None:
        """The stored result when `step` is a kept applied step and `fingerprint` is its
        batch's; None when it is the next step (the caller then runs the update and
        calls `record`).

        Raises:
            RpcError: INVALID_ARGUMENT for a negative step; FAILED_PRECONDITION naming
                the expected step for any other step, and naming the step for an
                applied step sent with another batch.
        """
        if step < 0:
            raise invalid_argument(field, f"must be >= 0, got {step}")
        if step in self._results:
            applied, result = self._results[step]
            if applied != fingerprint:
                raise failed_precondition(
                    f"{field}: {step} was already applied with another batch (fingerprint "
                    f"{applied[:12]}, this request's {fingerprint[:12]}); only a retry with "
                    f"the same batch is answered from the stored result. Another trainer or "
                    f"caller is updating this service: this service expects step "
                    f"{self.expected_step} next"
                )
            return result
        expected = self.expected_step
        if step == expected:
            return None
        if step > expected:
            raise failed_precondition(
                f"{field}: {step} skips ahead; this service expects step {expected} next "
                f"(its last applied step is {self.last_applied_step}), or a replay of one "
                f"of the last {len(self._results)} applied steps"
            )
        raise failed_precondition(
            f"{field}: {step} was applied but its result is no longer kept (only the last "
            f"{self.keep} are); this service expects step {expected} next"
        )

    def record(self, step: int, fingerprint: str, result: R) -> None:
        """Stores the result of the step just applied (must be `expected_step`)."""
        if step != self.expected_step:
            raise ValueError(f"recorded step {step}, expected {self.expected_step}")
        self.last_applied_step = step
        self._results[step] = (fingerprint, result)
        while len(self._results) > self.keep:
            self._results.popitem(last=False)

    def results(self) -> dict[int, R]:
        """Kept results by step, oldest first."""
        return {step: result for step, (_, result) in self._results.items()}

    def entries(self) -> list[tuple[int, str, R]]:
        """(step, batch fingerprint, result) of the kept steps, oldest first: what a
        checkpoint stores for `restore`."""
        return [
            (step, fingerprint, result) for step, (fingerprint, result) in self._results.items()
        ]

    def restore(self, last_applied_step: int, entries: list[tuple[int, str, R]]) -> None:
        """Replaces the ledger by a checkpoint's (entries oldest first)."""
        kept = [(int(step), str(fpr), result) for step, fpr, result in entries][-self.keep :]
        if any(step > last_applied_step for step, _, _ in kept):
            raise ValueError("a kept result is newer than the last applied step")
        self.last_applied_step = int(last_applied_step)
        self._results = OrderedDict((step, (fpr, result)) for step, fpr, result in kept)
