"""One stateful service's exclusive, deadline-bounded access to its workers.

Every service whose workers hold state (the rollout's actor, the critic) shares these
rules, so they live here once:

- **One call at a time.** An asyncio lock orders every call that touches the workers:
  a forward never sees half-updated weights and updates never interleave.
- **Deadlines.** A call waits for the lock and for its workers at most until the
  caller's deadline (and never longer than `call_timeout_s`); past it the caller gets
  DEADLINE_EXCEEDED naming the stage.
- **Atomic work.** An update, save or load is never cut in half: it runs as a task of
  its own, detached from the request. A caller whose deadline passes gets
  DEADLINE_EXCEEDED saying the work continues; a caller that goes away (a killed
  trainer) cancels nothing. Detaching takes two steps: asyncio's shield keeps the
  request's cancellation out of the task, and a fresh Ray task context keeps Ray's
  *recursive* cancellation (Serve cancels a request whose client hung up, and Ray then
  cancels every worker call that request made) away from the task's worker calls.
- **Known or broken.** Work that fails after it reached the workers may have left ranks
  out of step; `mark_broken` records why, `check_usable` then refuses work with
  FAILED_PRECONDITION and `problems()` fails the health check (Serve replaces the
  replica with freshly loaded weights), until a successful load calls `mark_known`.
"""

import asyncio
import contextvars
import math
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc

from rlserve.core.serving import Deadline, RpcError, deadline_exceeded, failed_precondition

T = TypeVar("T")


def detached_task(work: Coroutine[Any, Any, T]) -> "asyncio.Task[T]":
    """`work` as a task that keeps running when the request that started it is cancelled,
    by asyncio or by Ray (await it through `asyncio.shield`)."""
    context = contextvars.copy_context()  # keeps the trace context: spans still nest
    context.run(_leave_ray_task)
    task = asyncio.get_running_loop().create_task(work, context=context)
    # A caller that stopped waiting never reads the outcome; mark it read.
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    return task


def _leave_ray_task() -> None:
    """Forgets, in the current context, which Ray actor task is running, so calls made
    from it are not that task's children (Ray cancels children with their parent)."""
    try:
        from ray import _raylet
    except ImportError:  # no Ray: nothing would cancel recursively
        return
    task_id = getattr(_raylet, "async_task_id", None)
    if task_id is not None:
        task_id.set(None)


class ExclusiveAccess:
    """The lock, deadlines and known/broken state of one service's workers."""

    def __init__(self, role: str, call_timeout_s: float = math.inf):
        self.role = role
        self.call_timeout_s = call_timeout_s
        self._lock = asyncio.Lock()
        self.broken: str | None = None
        """Why the workers' state may differ between ranks or from what the service
        reports (an update or load that failed part-way); None while it is known."""

    def problems(self) -> list[str]:
        """The health check's line about the state, if it is broken."""
        return [] if self.broken is None else [f"weights may be inconsistent: {self.broken}"]

    def check_usable(self) -> None:
        if self.broken is not None:
            raise failed_precondition(
                f"the {self.role}'s weights may be inconsistent: {self.broken}; call "
                "LoadCheckpoint to restore a known state, or Reset for the initial one"
            )

    def mark_broken(self, what: str, error: BaseException) -> None:
        self.broken = f"{what} failed part-way ({type(error).__name__}: {str(error)[:200]})"

    def mark_known(self) -> None:
        self.broken = None

    async def run(
        self, stage: str, work: Callable[[], Awaitable[T]], deadline: Deadline, atomic: bool
    ) -> T:
        """`work()` holding the lock, within the caller's deadline.

        atomic=False: at the deadline the wait (for the lock or the workers) is cancelled.
        atomic=True: once it holds the lock, `work` runs to completion even when the
        caller stops waiting or goes away; it starts only if the deadline has not passed
        by the time the lock is free.
        """
        if not atomic:
            holding = False
            try:
                async with asyncio.timeout(self._timeout_s(deadline)):
                    async with self._lock:
                        holding = True
                        return await work()
            except TimeoutError:
                where = stage if holding else f"{stage} (waiting for an earlier call)"
                raise deadline_exceeded(where) from None

        started = False

        async def locked() -> T:
            nonlocal started
            async with self._lock:
                deadline.check(stage)
                started = True
                try:
                    async with asyncio.timeout(self.call_timeout_s):
                        return await work()
                except TimeoutError:
                    raise RpcError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"{stage}: the workers did not answer within {self.call_timeout_s:g} s",
                    ) from None

        task = detached_task(locked())
        try:
            return await asyncio.wait_for(asyncio.shield(task), self._timeout_s(deadline))
        except TimeoutError:
            if started:
                raise deadline_exceeded(f"{stage}; it continues and will complete") from None
            task.cancel()  # still waiting for the lock: it never starts
            raise deadline_exceeded(f"{stage} (waiting for an earlier call)") from None

    async def run_unlocked(self, stage: str, work: Awaitable[T], deadline: Deadline) -> T:
        """`work` within the caller's deadline, beside whatever holds the lock (work on
        state that never changes, e.g. frozen reference weights)."""
        return await within_deadline(stage, work, deadline, self.call_timeout_s)

    def _timeout_s(self, deadline: Deadline) -> float | None:
        return _timeout_s(deadline, self.call_timeout_s)


async def within_deadline(
    stage: str, work: Awaitable[T], deadline: Deadline, call_timeout_s: float = math.inf
) -> T:
    """`work` within the caller's deadline (and `call_timeout_s`), cancelled at it:
    DEADLINE_EXCEEDED naming `stage`. The wait of work on state that never changes (no
    lock: the reference service, the rollout's merged reference)."""
    try:
        return await asyncio.wait_for(work, _timeout_s(deadline, call_timeout_s))
    except TimeoutError:
        raise deadline_exceeded(stage) from None


def _timeout_s(deadline: Deadline, call_timeout_s: float) -> float | None:
    timeout_s = min(call_timeout_s, max(0.0, deadline.remaining_s()))
    return None if timeout_s == math.inf else timeout_s
