"""RunLease: one run at a time may change a stateful service; the lease lapses unless
renewed, and a service no run holds takes calls from anyone with the token."""

import grpc
import pytest

from rlserve.core.lease import RUN_ID_METADATA_KEY, RunLease, caller_run_id
from rlserve.core.serving import RpcError


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _from(run_id: str) -> list[tuple[str, str]]:
    return [("application", "rollout"), (RUN_ID_METADATA_KEY, run_id)]


def test_a_held_lease_refuses_other_runs_and_callers_naming_none():
    clock = Clock()
    lease = RunLease("rollout", clock)
    lease.check("Reset", [])  # unleased: anyone with the token
    assert lease.take("run-a", 30) == ("run-a", 30)
    lease.check("UpdateActor", _from("run-a"))
    for metadata, who in ((_from("run-b"), "from run 'run-b'"), ([], "naming no run")):
        with pytest.raises(RpcError) as refused:
            lease.check("Reset", metadata)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "rollout is leased by run 'run-a' (lapses in 30 s" in refused.value.message
        assert f"Reset {who}" in refused.value.message
    with pytest.raises(RpcError) as refused:
        lease.take("run-b", 30)
    assert "Lease for run 'run-b' refused" in refused.value.message


def test_a_lease_lapses_unless_renewed_and_is_released_by_its_holder_only():
    clock = Clock()
    lease = RunLease("critic", clock)
    lease.take("run-a", 30)
    clock.now += 20
    assert lease.take("run-a", 30) == ("run-a", 30)  # renewed
    clock.now += 29
    assert lease.current() == ("run-a", pytest.approx(1))
    clock.now += 2  # lapsed: the holder stopped renewing
    assert lease.current() == ("", 0.0)
    lease.check("UpdateCritic", _from("run-b"))
    assert lease.take("run-b", 10)[0] == "run-b"
    assert lease.release("run-a") == ("run-b", 10)  # not the holder: nothing changes
    assert lease.release("run-b") == ("", 0.0)


@pytest.mark.parametrize(
    ("run_id", "ttl_s", "message"),
    [
        ("", 30, "run_id: empty"),
        ("x" * 129, 30, "run_id: 129 characters; at most 128"),
        ("run\n", 30, "run_id: only printable ASCII"),
        ("rün", 30, "run_id: only printable ASCII"),
        ("run", 0, "ttl_s: must be > 0 and <= 3600 s"),
        ("run", float("nan"), "ttl_s: must be > 0"),
        ("run", 1e9, "ttl_s: must be > 0 and <= 3600 s"),
    ],
)
def test_bad_lease_requests_name_the_field(run_id, ttl_s, message):
    with pytest.raises(RpcError) as refused:
        RunLease("rollout").take(run_id, ttl_s)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in refused.value.message


def test_the_run_id_comes_from_metadata_as_text_or_bytes():
    assert caller_run_id([(RUN_ID_METADATA_KEY, b"run-a")]) == "run-a"
    assert caller_run_id(None) == ""
