"""ExclusiveAccess: one call at a time, deadlines, atomic work that outlives its caller."""

import asyncio
import time

import grpc
import pytest
from ray import _raylet

from rlserve.core.exclusive import ExclusiveAccess
from rlserve.core.serving import Deadline, RpcError


def _in(seconds: float) -> Deadline:
    return Deadline(time.time() + seconds)


def test_atomic_work_finishes_when_its_caller_is_cancelled():
    async def scenario() -> list[str]:
        access, events = ExclusiveAccess("critic"), []

        async def work() -> None:
            await asyncio.sleep(0.05)
            events.append("finished")

        caller = asyncio.ensure_future(access.run("Update", work, Deadline(), atomic=True))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        # the next call waits for the lock the atomic work still holds
        await access.run("Next", lambda: asyncio.sleep(0, events.append("next")), Deadline(), True)
        return events

    assert asyncio.run(scenario()) == ["finished", "next"]


def test_atomic_work_runs_outside_the_ray_task_that_started_it():
    """Ray cancels the worker calls a cancelled request made (its children); atomic work
    must not count as the request's."""

    async def scenario() -> tuple[object, object]:
        access = ExclusiveAccess("critic")
        _raylet.async_task_id.set(b"request-task")  # what Ray sets while a request runs

        async def work() -> object:
            return _raylet.async_task_id.get()

        inside_atomic = await access.run("Update", work, Deadline(), atomic=True)
        inside_plain = await access.run("Forward", work, Deadline(), atomic=False)
        return inside_atomic, inside_plain

    inside_atomic, inside_plain = asyncio.run(scenario())
    assert inside_atomic is None
    assert inside_plain == b"request-task"  # a forward nobody waits for may be cancelled


def test_a_passed_deadline_leaves_started_atomic_work_running_and_unstarted_work_undone():
    async def scenario() -> tuple[list[str], list[str]]:
        access, events, messages = ExclusiveAccess("critic"), [], []

        async def slow() -> None:
            await asyncio.sleep(0.2)
            events.append("slow finished")

        async def never() -> None:
            events.append("never ran")

        first = asyncio.ensure_future(access.run("Update step 1", slow, _in(0.05), atomic=True))
        await asyncio.sleep(0.01)
        for call in (first, access.run("Update step 2", never, _in(0.05), atomic=True)):
            with pytest.raises(RpcError) as error:
                await call
            assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            messages.append(error.value.message)
        await asyncio.sleep(0.3)
        return events, messages

    events, messages = asyncio.run(scenario())
    assert events == ["slow finished"]
    assert messages == [
        "caller's deadline passed during Update step 1; it continues and will complete",
        "caller's deadline passed during Update step 2 (waiting for an earlier call)",
    ]


def test_plain_work_is_cancelled_at_the_deadline_and_bounded_by_the_call_timeout():
    async def scenario() -> list[str]:
        events, messages = [], []

        async def slow() -> None:
            try:
                await asyncio.sleep(1.0)
            except asyncio.CancelledError:
                events.append("cancelled")
                raise

        for access, deadline in (
            (ExclusiveAccess("critic"), _in(0.05)),
            (ExclusiveAccess("critic", call_timeout_s=0.05), Deadline()),
        ):
            with pytest.raises(RpcError) as error:
                await access.run("ComputeValues", slow, deadline, atomic=False)
            assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            messages.append(error.value.message)
        return events + messages

    assert (
        asyncio.run(scenario())
        == ["cancelled", "cancelled"] + ["caller's deadline passed during ComputeValues"] * 2
    )


def test_a_broken_state_refuses_work_and_fails_the_health_check_until_known():
    access = ExclusiveAccess("critic")
    assert access.problems() == []
    access.check_usable()
    access.mark_broken("UpdateCritic step 3", RuntimeError("rank 1 died"))
    with pytest.raises(RpcError) as error:
        access.check_usable()
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "UpdateCritic step 3 failed part-way" in error.value.message
    assert "LoadCheckpoint" in error.value.message
    assert access.problems() == [
        "weights may be inconsistent: UpdateCritic step 3 failed part-way "
        "(RuntimeError: rank 1 died)"
    ]
    access.mark_known()
    assert access.problems() == []
