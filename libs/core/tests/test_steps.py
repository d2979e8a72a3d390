"""StepLedger: the next step or a replay of a kept one; anything else names the expected step."""

import grpc
import pytest

from rlserve.core.serving import RpcError
from rlserve.core.steps import StepLedger


def refused(ledger: StepLedger, step: int) -> RpcError:
    with pytest.raises(RpcError) as error:
        ledger.replay_or_require_next(step)
    return error.value


def test_a_fresh_ledger_takes_step_0_only():
    ledger = StepLedger(keep=2)
    assert ledger.expected_step == 0 and ledger.replay_or_require_next(0) is None
    for step in (1, 2**63 - 1):
        error = refused(ledger, step)
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert error.message.startswith(f"step: {step} skips ahead")
        assert "expects step 0 next" in error.message
    error = refused(ledger, -1)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == "step: must be >= 0, got -1"


def test_next_step_then_replays_of_kept_steps_only():
    ledger = StepLedger(keep=2)
    for step in range(3):
        assert ledger.replay_or_require_next(step) is None
        ledger.record(step, f"result {step}")
    assert ledger.last_applied_step == 2 and ledger.expected_step == 3
    assert ledger.replay_or_require_next(1) == "result 1"
    assert ledger.replay_or_require_next(2) == "result 2"
    assert ledger.replay_or_require_next(3) is None
    old = refused(ledger, 0)  # applied, but only the last 2 are kept
    assert old.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no longer kept" in old.message and "expects step 3 next" in old.message
    poison = refused(ledger, 2**63 - 1)
    assert "expects step 3 next" in poison.message
    assert ledger.last_applied_step == 2  # a refused step changes nothing


def test_record_takes_only_the_expected_step():
    ledger = StepLedger(keep=1)
    with pytest.raises(ValueError, match="recorded step 5, expected 0"):
        ledger.record(5, "x")


def test_state_round_trip_and_restore_keeps_the_newest():
    ledger = StepLedger(keep=3)
    for step in range(5):
        ledger.record(step, {"loss": float(step)})
    state = ledger.state()
    assert state == {
        "last_applied_step": 4,
        "results": [[2, {"loss": 2.0}], [3, {"loss": 3.0}], [4, {"loss": 4.0}]],
    }
    restored = StepLedger(keep=2)
    restored.restore(state["last_applied_step"], state["results"])
    assert restored.results() == {3: {"loss": 3.0}, 4: {"loss": 4.0}}
    assert restored.expected_step == 5
    with pytest.raises(ValueError, match="newer than the last applied step"):
        restored.restore(1, [(2, {})])
