"""A run's lease on a stateful service: one run at a time may change its state.

The token says a caller may use the cluster's services; it does not say which run a
rollout or critic service is training for. Without a lease a second `rlserve train`
resets the services under a live run, and anyone with the token applies updates. So a
run takes a lease (run id, time to live) before it resets or updates anything, renews
it while it runs, and releases it at its end; every call it makes carries its run id
as metadata `rlserve-run-id`. While the lease lasts, the calls that change the state
from another run, or from a caller that names none, are refused with
FAILED_PRECONDITION naming the holder. A holder that dies without releasing stops
renewing, and the lease lapses after its ttl_s; the same run resumed (same run id)
takes it back at once. A service that no run holds takes calls from anyone with the
token, as before leases existed (tools, tests, a hand-driven service).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from rlserve.core.serving import RpcError
from rlserve.v1 import common_pb2

RUN_ID_METADATA_KEY = "rlserve-run-id"
MAX_RUN_ID_CHARS = 128
MAX_TTL_S = 3600.0


def run_id_metadata(run_id: str) -> tuple[str, str]:
    return (RUN_ID_METADATA_KEY, run_id)


def caller_run_id(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The run id a call's metadata names ("" for none)."""
    for key, value in metadata or ():
        if key == RUN_ID_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def _invalid(field: str, message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


def check_run_id(run_id: str, field: str = "run_id") -> str:
    if not run_id:
        raise _invalid(field, "empty; give the run's id (its run directory's name)")
    if len(run_id) > MAX_RUN_ID_CHARS:
        raise _invalid(field, f"{len(run_id)} characters; at most {MAX_RUN_ID_CHARS}")
    if not (run_id.isascii() and run_id.isprintable()):
        raise _invalid(field, "only printable ASCII characters are allowed")
    return run_id


class RunLease:
    """The lease of one service replica (kept in memory: a replaced replica starts
    unleased, and its holder takes it again with its next renewal)."""

    def __init__(self, service: str, clock: Callable[[], float] = time.monotonic):
        self.service = service
        self.clock = clock
        self.holder = ""
        self.expires_at = 0.0

    def current(self) -> tuple[str, float]:
        """(holder, seconds left); ("", 0) when none holds it or it lapsed."""
        left = self.expires_at - self.clock()
        if not self.holder or left <= 0:
            return "", 0.0
        return self.holder, left

    def take(self, run_id: str, ttl_s: float) -> tuple[str, float]:
        """Takes or renews the lease for `run_id`; FAILED_PRECONDITION while another
        run holds it."""
        check_run_id(run_id)
        if not (0 < ttl_s <= MAX_TTL_S):
            raise _invalid("ttl_s", f"must be > 0 and <= {MAX_TTL_S:g} s; got {ttl_s:g}")
        holder, _ = self.current()
        if holder and holder != run_id:
            raise self._held_by_another(f"Lease for run {run_id!r}")
        self.holder, self.expires_at = run_id, self.clock() + ttl_s
        return self.current()

    def release(self, run_id: str) -> tuple[str, float]:
        """Releases the lease if `run_id` holds it; releasing one not held is a no-op."""
        check_run_id(run_id)
        holder, _ = self.current()
        if holder == run_id:
            self.holder, self.expires_at = "", 0.0
        return self.current()

    def answer(self, request: Any) -> common_pb2.RunLease:
        """A Lease RPC's answer (its request's release, run_id and ttl_s): the lease as it
        stands after taking or releasing it."""
        if request.release:
            holder, left = self.release(request.run_id)
        else:
            holder, left = self.take(request.run_id, request.ttl_s)
        return common_pb2.RunLease(holder=holder, expires_in_s=left)

    def info(self) -> common_pb2.RunLease:
        """The lease as it stands, for GetInfo."""
        holder, left = self.current()
        return common_pb2.RunLease(holder=holder, expires_in_s=left)

    def check(self, rpc: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> None:
        """FAILED_PRECONDITION unless the caller may change the state: no lease is held,
        or the call names the holder."""
        holder, _ = self.current()
        if holder and caller_run_id(metadata) != holder:
            caller = caller_run_id(metadata)
            who = f"from run {caller!r}" if caller else "naming no run (metadata rlserve-run-id)"
            raise self._held_by_another(f"{rpc} {who}")

    def _held_by_another(self, refused: str) -> RpcError:
        holder, left = self.current()
        return RpcError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{self.service} is leased by run {holder!r} (lapses in {left:.0f} s unless "
            f"renewed): {refused} refused. Wait for that run to end, stop it "
            "(`rlserve run stop RUN_DIR`), or resume it instead of starting another",
        )
