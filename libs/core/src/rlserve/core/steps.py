"""Which training steps a stateful service has applied: the one rule for update steps.

An update RPC (UpdateActor, UpdateCritic) carries the trainer's step number. A service
accepts exactly two kinds of step:

- **the next step**, last applied + 1 (0 for a service that applied none): the update
  runs, and `record` stores its result;
- **a replay** of an applied step whose result is still kept (the last `keep`): the
  stored result is answered and nothing trains, so a caller's retry is never applied
  twice.

Anything else is FAILED_PRECONDITION naming the expected step: a step that skips ahead
(one call with step 2^63-1 would otherwise make every later real step "old"), and an old
step whose result is no longer kept. A negative step is INVALID_ARGUMENT.

The ledger is plain data (no locking, no I/O): each controller calls it under its own
lock, and saves `state()` with its checkpoints so a restored service replays the same
steps. Results are whatever the service stores (metrics, the version after the step...)
and must be JSON-like for `state()` to go into a checkpoint.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Generic, TypeVar

from rlserve.core.serving import failed_precondition, invalid_argument

R = TypeVar("R")


class StepLedger(Generic[R]):
    """Applied steps and the kept results of the latest ones.

    Args:
        keep: how many most recent applied steps stay replayable (>= 1).
    """

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.last_applied_step = -1
        self._results: OrderedDict[int, R] = OrderedDict()

    @property
    def expected_step(self) -> int:
        """The only new step this service accepts."""
        return self.last_applied_step + 1

    def replay_or_require_next(self, step: int, field: str = "step") -> R | None:
        """The stored result when `step` is a kept applied step; None when it is the next
        step (the caller then runs the update and calls `record`).

        Raises:
            RpcError: INVALID_ARGUMENT for a negative step; FAILED_PRECONDITION naming
                the expected step for any other step.
        """
        if step < 0:
            raise invalid_argument(field, f"must be >= 0, got {step}")
        if step in self._results:
            return self._results[step]
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

    def record(self, step: int, result: R) -> None:
        """Stores the result of the step just applied (must be `expected_step`)."""
        if step != self.expected_step:
            raise ValueError(f"recorded step {step}, expected {self.expected_step}")
        self.last_applied_step = step
        self._results[step] = result
        while len(self._results) > self.keep:
            self._results.popitem(last=False)

    def results(self) -> dict[int, R]:
        """Kept results by step, oldest first."""
        return dict(self._results)

    def state(self) -> dict[str, Any]:
        """JSON-like state for a checkpoint: last applied step and kept results."""
        return {
            "last_applied_step": self.last_applied_step,
            "results": [[step, result] for step, result in self._results.items()],
        }

    def restore(self, last_applied_step: int, results: list[tuple[int, R]]) -> None:
        """Replaces the ledger by a checkpoint's (results oldest first)."""
        kept = [(int(step), result) for step, result in results][-self.keep :]
        if any(step > last_applied_step for step, _ in kept):
            raise ValueError("a kept result is newer than the last applied step")
        self.last_applied_step = int(last_applied_step)
        self._results = OrderedDict(kept)
