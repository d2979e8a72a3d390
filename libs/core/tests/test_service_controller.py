"""StatefulController: the one update rule (checks → broken? → replay → apply), the one
checkpoint format, and loads that fail part-way, over a fake group (no model, no Ray)."""

import asyncio
import re

import grpc
import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.service.controller import (
    AppliedStep,
    StatefulController,
    UpdateWork,
    parse_client_state,
)
from rlserve.core.serving import Deadline, RpcError, invalid_argument


class FakeGroup:
    """Records calls; `fail` maps a method name to the exception it raises."""

    def __init__(self, ranks: int = 1):
        self.ranks, self.calls, self.fail, self.client_state = ranks, [], {}, {}

    def __len__(self) -> int:
        return self.ranks

    def dead_workers(self) -> list[str]:
        return []

    async def run_each(self, method, shares, fail=None):
        """Each rank's share back, or `fail` raised (a rank lost part-way)."""
        self.calls.append(method)
        if fail is not None:
            raise fail
        return shares

    async def run_all(self, method, *args, **kwargs):
        self.calls.append(method)
        if method in self.fail:
            raise self.fail[method]
        if method == "check_checkpoint":
            return [self.client_state] * self.ranks
        return [None] * self.ranks


class Controller(StatefulController):
    checkpoint_root = None  # set per test

    def __init__(self, group):
        super().__init__(group, "critic", "critic checkpoint", keep=4)

    async def train(self, step, batch, fail=None, precondition=None):
        async def check():
            if not len(batch):
                raise invalid_argument("batch", "empty batch")
            return UpdateWork(
                "update",
                [batch] * len(self.group),
                lambda answers, update_s: ({"loss": float(answers[0]["x"].sum())}, None),
                {"fail": fail},
            )

        return await self.update("UpdateCritic", step, batch, Deadline(), check, precondition)


def batch(value: float) -> Batch:
    return Batch({"x": torch.full((2,), value)})


def run(coroutine):
    return asyncio.run(coroutine)


def refused(coroutine) -> RpcError:
    with pytest.raises(RpcError) as error:
        run(coroutine)
    return error.value


def test_a_retry_replays_without_the_precondition_and_a_new_step_checks_it():
    controller = Controller(FakeGroup())
    record, replayed = run(controller.train(0, batch(1.0)))
    assert (record, replayed) == (AppliedStep(1, {"loss": 2.0}), False)

    def stale():
        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "weights_version: stale")

    assert run(controller.train(0, batch(1.0), precondition=stale)) == (record, True)
    assert refused(controller.train(1, batch(2.0), precondition=stale)).message == (
        "weights_version: stale"
    )
    assert controller.weights_version == 1 and controller.last_applied_step == 0


def test_a_broken_state_refuses_replays_too_and_checks_come_first():
    controller = Controller(FakeGroup())
    run(controller.train(0, batch(1.0)))
    with pytest.raises(RuntimeError, match="rank 1 lost"):
        run(controller.train(1, batch(2.0), fail=RuntimeError("rank 1 lost")))
    assert "UpdateCritic step 1 failed part-way" in controller.health_problems()[0]
    # the request's own checks answer whatever the state
    error = refused(controller.train(2, Batch({"x": torch.zeros(0)})))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    # broken before replay: the kept step 0 is not answered from the ledger
    error = refused(controller.train(0, batch(1.0)))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "call LoadCheckpoint" in error.message
    assert run(controller.reset()) == (0, -1)
    assert controller.health_problems() == []
    assert run(controller.train(0, batch(3.0)))[1] is False


def test_one_client_state_format_round_trips_and_the_critics_former_one_loads():
    controller = Controller(FakeGroup())
    for step in range(2):
        run(controller.train(step, batch(float(step))))
    state = controller.client_state()
    assert list(state) == ["weights_version", "last_applied_step", "updates"]
    parsed = parse_client_state(state)
    assert (parsed.weights_version, parsed.last_applied_step) == (2, 1)
    assert parsed.updates == controller.steps.entries()
    former = {
        "weights_version": 3,
        "last_applied_step": 2,
        "applied": [[1, {"vf_loss": 1.0}, 2], [2, {"vf_loss": 0.5}, 3, "abc"]],
    }
    assert parse_client_state(former).updates == [
        (1, "", AppliedStep(2, {"vf_loss": 1.0})),
        (2, "abc", AppliedStep(3, {"vf_loss": 0.5})),
    ]
    for bad, reason in (
        ({"weights_version": 1, "last_applied_step": 0}, "lacks ['updates']"),
        ({**state, "last_applied_step": "latest"}, "malformed"),
    ):
        with pytest.raises(ValueError, match=re.escape(reason)):
            parse_client_state(bad)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_load_whose_files_vanish_is_refused_with_one_rank_and_broken_with_more(tmp_path, ranks):
    group = FakeGroup(ranks)
    controller = Controller(group)
    controller.checkpoint_root = str(tmp_path)
    (tmp_path / "ckpt" / "deepspeed" / "state").mkdir(parents=True)
    group.client_state = Controller(FakeGroup()).client_state()
    group.fail["load_checkpoint"] = FileNotFoundError("gone")
    if ranks == 1:
        error = refused(controller.load_checkpoint("ckpt"))
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert controller.health_problems() == []
    else:
        with pytest.raises(FileNotFoundError):
            run(controller.load_checkpoint("ckpt"))
        assert "LoadCheckpoint of 'ckpt' failed part-way" in controller.health_problems()[0]
    del group.fail["load_checkpoint"]
    assert run(controller.load_checkpoint("ckpt")) == (0, -1)
    assert controller.health_problems() == []
    error = refused(controller.load_checkpoint("missing"))
    assert error.message.startswith("location.path: no critic checkpoint at ")
