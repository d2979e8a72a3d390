"""The run's leases on its stateful services: taken before anything changes, renewed
while the run lasts, released at its end (rlserve.core.lease has the service side)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

import grpc

from rlserve.core import tracing
from rlserve.v1 import critic_pb2, rollout_pb2

logger = logging.getLogger(__name__)

_REQUESTS = {
    "rollout": rollout_pb2.RolloutServiceLeaseRequest,
    "critic": critic_pb2.CriticServiceLeaseRequest,
}


class LeaseRefused(RuntimeError):
    """Another run holds a service this run needs."""


def run_id_of(run_dir: Path) -> str:
    """The run's id: its directory's name, made unique by a hash of the whole path (two
    runs named alike elsewhere are other runs; a resumed run is the same one)."""
    path = str(Path(run_dir).resolve())
    return f"{Path(path).name[:100]}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


class LeaseKeeper:
    """Holds the leases of one run on its rollout and critic services."""

    def __init__(self, clients: Any, run_id: str, ttl_s: float):
        self.clients = {
            role: client
            for role, client in (("rollout", clients.rollout), ("critic", clients.critic))
            if client is not None
        }
        self.run_id = run_id
        self.ttl_s = ttl_s
        self._renewing: asyncio.Task | None = None
        self._held = False

    async def _lease(self, role: str, release: bool = False) -> Any:
        request = _REQUESTS[role](run_id=self.run_id, ttl_s=self.ttl_s, release=release)
        return (await self.clients[role].call("Lease", request)).lease

    async def take(self) -> None:
        """Takes every lease, then renews them every ttl_s / 3 in the background.

        Raises:
            LeaseRefused: a service is leased by another run (named in the message).
        """
        try:
            with tracing.span("trainer.lease", action="take"):
                await asyncio.gather(*(self._lease(role) for role in self.clients))
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self._held = True
            await self.release()  # the leases that were taken
            raise LeaseRefused(error.details()) from None
        self._held = True
        self._renewing = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            # One trace per renewal, named, rather than a bare client call per service.
            with tracing.span("trainer.lease", action="renew"):
                for role in self.clients:
                    try:
                        await self._lease(role)
                    except grpc.aio.AioRpcError as error:
                        # A replaced replica starts unleased and is taken again on the
                        # next renewal; a lease another run took after this one's lapsed
                        # makes the run's next update fail with that run's name.
                        logger.warning(
                            "renewing the %s lease of run %s failed: %s: %s",
                            role,
                            self.run_id,
                            error.code().name,
                            error.details(),
                        )

    async def release(self) -> None:
        """Stops renewing and releases the leases (a service that is gone is skipped);
        a second call does nothing."""
        if self._renewing is not None:
            self._renewing.cancel()
            self._renewing = None
        if not self._held:
            return
        self._held = False
        with tracing.span("trainer.lease", action="release"):
            results = await asyncio.gather(
                *(self._lease(role, release=True) for role in self.clients),
                return_exceptions=True,
            )
        for role, result in zip(self.clients, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("releasing the %s lease of run %s: %s", role, self.run_id, result)
