"""StepLedger: the next step or a replay of a kept one with its own batch; anything else
names the expected step."""

import grpc
import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.serving import RpcError
from rlserve.core.steps import StepLedger, batch_fingerprint


def refused(ledger: StepLedger, step: int, fingerprint: str = "batch") -> RpcError:
    with pytest.raises(RpcError) as error:
        ledger.replay_or_require_next(step, fingerprint)
    return error.value


def test_a_fresh_ledger_takes_step_0_only():
    ledger = StepLedger(keep=2)
    assert ledger.expected_step == 0 and ledger.replay_or_require_next(0, "a") is None
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
        assert ledger.replay_or_require_next(step, f"batch {step}") is None
        ledger.record(step, f"batch {step}", f"result {step}")
    assert ledger.last_applied_step == 2 and ledger.expected_step == 3
    assert ledger.replay_or_require_next(1, "batch 1") == "result 1"
    assert ledger.replay_or_require_next(2, "batch 2") == "result 2"
    assert ledger.replay_or_require_next(3, "batch 3") is None
    old = refused(ledger, 0, "batch 0")  # applied, but only the last 2 are kept
    assert old.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no longer kept" in old.message and "expects step 3 next" in old.message
    poison = refused(ledger, 2**63 - 1)
    assert "expects step 3 next" in poison.message
    assert ledger.last_applied_step == 2  # a refused step changes nothing


def test_an_applied_step_sent_with_another_batch_is_refused_not_replayed():
    """A second trainer applied step 2 with its own batch first: the run's own step 2 is
    told so, instead of being answered 'replayed' with the other batch's result."""
    ledger = StepLedger(keep=4)
    ledger.record(0, "run's step 0", "ours")
    ledger.record(1, "intruder's step 1", "theirs")
    error = refused(ledger, 1, "run's step 1")
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.message.startswith("step: 1 was already applied with another batch")
    assert "expects step 2 next" in error.message
    assert ledger.replay_or_require_next(0, "run's step 0") == "ours"


def test_record_takes_only_the_expected_step():
    ledger = StepLedger(keep=1)
    with pytest.raises(ValueError, match="recorded step 5, expected 0"):
        ledger.record(5, "f", "x")


def test_entries_round_trip_and_restore_keeps_the_newest():
    ledger = StepLedger(keep=3)
    for step in range(5):
        ledger.record(step, f"f{step}", {"loss": float(step)})
    entries = ledger.entries()
    assert entries == [(2, "f2", {"loss": 2.0}), (3, "f3", {"loss": 3.0}), (4, "f4", {"loss": 4.0})]
    restored = StepLedger(keep=2)
    restored.restore(ledger.last_applied_step, [list(entry) for entry in entries])
    assert restored.results() == {3: {"loss": 3.0}, 4: {"loss": 4.0}}
    assert restored.expected_step == 5
    assert restored.replay_or_require_next(4, "f4") == {"loss": 4.0}
    assert refused(restored, 4, "f3").code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(ValueError, match="newer than the last applied step"):
        restored.restore(1, [(2, "f", {})])


def test_the_fingerprint_sees_every_value_and_shape_but_not_meta():
    ids = torch.arange(6).reshape(2, 3)
    base = batch_fingerprint(Batch({"input_ids": ids}, meta={"weights_version": 1}))
    assert base == batch_fingerprint(Batch({"input_ids": ids.clone()}, meta={}))
    changed = ids.clone()
    changed[1, 2] = 99
    assert batch_fingerprint(Batch({"input_ids": changed})) != base
    assert batch_fingerprint(Batch({"input_ids": ids.reshape(3, 2)})) != base
    assert batch_fingerprint(Batch({"input_ids": ids.float()})) != base
    assert batch_fingerprint(Batch({"input_ids": torch.zeros(0, 3, dtype=torch.long)})) != base
