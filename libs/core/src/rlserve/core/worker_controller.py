"""What every worker service's controller asks of its worker group.

Every service's controller subclasses `WorkerController` (the stateful ones through
rlserve.core.service.controller.StatefulController): the ranks' facts for GetInfo
(asked once: workers never move, and asking again would queue behind a long update),
the health check's dead workers, and the sequence checks every request gets against
the model's vocabulary and the service's request limits (`bounds`).
"""

from dataclasses import dataclass
from typing import Any

from rlserve.core.batch import Batch
from rlserve.core.service.methods import INFO
from rlserve.core.tensor_checks import require_sequences


@dataclass(frozen=True)
class RequestBounds:
    """The most one request may carry (a service config's RequestLimits fields)."""

    max_batch_samples: int
    max_request_tokens: int
    """Rows × input_ids columns."""


class WorkerController:
    """A service controller over `group` (WorkerGroup's async interface)."""

    def __init__(self, group: Any, bounds: RequestBounds | None = None):
        self.group = group
        self.bounds = bounds
        self._worker_infos: list[dict[str, Any]] | None = None

    def health_problems(self) -> list[str]:
        """Why this service cannot serve (a subclass adds its own state's problems)."""
        return self.group.dead_workers()

    async def worker_infos(self) -> list[dict[str, Any]]:
        """rank, node_id, hostname, pid, vocab_size of every worker (asked once)."""
        if self._worker_infos is None:
            self._worker_infos = await self.group.run_all(INFO)
        return self._worker_infos

    async def vocab_size(self) -> int:
        return (await self.worker_infos())[0]["vocab_size"]

    async def checked_sequences(self, batch: Batch) -> Batch:
        """The request's sequence tensors, checked (rlserve.core.tensor_checks
        .require_sequences) against the vocabulary and this service's limits."""
        if self.bounds is None:
            raise TypeError("checked_sequences needs the controller's RequestBounds")
        return require_sequences(
            batch,
            await self.vocab_size(),
            self.bounds.max_batch_samples,
            max_tokens=self.bounds.max_request_tokens,
        )
