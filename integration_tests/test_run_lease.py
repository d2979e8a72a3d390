"""A run holds its rollout and critic services by a lease: a second run, or a caller
naming no run, cannot reset or update them under it; a lapsed or released lease lets
the next run in."""

import asyncio
import threading
import time

import grpc
import pytest

from integration_tests.support import fresh_services, run_inputs, tiny_run_config
from rlserve.core.lease import run_id_metadata
from rlserve.core.rpc import call_metadata
from rlserve.trainer.lease_keeper import LeaseRefused, run_id_of
from rlserve.trainer.metrics import read_metrics
from rlserve.trainer.run import train_on_services
from rlserve.v1 import critic_pb2, critic_pb2_grpc, rollout_pb2, rollout_pb2_grpc


def _train(config, inputs, run_dir, address):
    return asyncio.run(train_on_services(config, inputs, run_dir, address, show_progress=False))


def _lease_holder(channel, role: str) -> str:
    stub_cls, request = {
        "rollout": (rollout_pb2_grpc.RolloutServiceStub, rollout_pb2.RolloutServiceGetInfoRequest),
        "critic": (critic_pb2_grpc.CriticServiceStub, critic_pb2.CriticServiceGetInfoRequest),
    }[role]
    info = stub_cls(channel).GetInfo(request(), metadata=call_metadata(role), timeout=10).info
    return info.lease.holder


def test_a_second_run_and_callers_naming_no_run_are_refused_while_a_run_holds_the_lease(
    serve_cluster, embedded, tmp_path
):
    inputs = run_inputs(embedded)
    address = serve_cluster.grpc_address
    config = tiny_run_config(tmp_path, trainer={"total_steps": 8, "lease_ttl_s": 30})
    fresh_services(config, inputs)
    channel = serve_cluster.channel()
    rollout = rollout_pb2_grpc.RolloutServiceStub(channel)

    # Someone else's lease, not renewed: the run is refused, naming it, until it lapses.
    taken = rollout.Lease(
        rollout_pb2.RolloutServiceLeaseRequest(run_id="someone-else", ttl_s=4),
        metadata=call_metadata("rollout"),
        timeout=10,
    )
    assert taken.lease.holder == "someone-else"
    with pytest.raises(LeaseRefused, match="rollout is leased by run 'someone-else'"):
        _train(config, inputs, tmp_path / "refused", address)
    # the refused run took no lease of its own on the critic either
    assert _lease_holder(channel, "critic") == ""
    time.sleep(4.5)

    # A run in progress holds both; another run and anonymous state changes are refused.
    first_dir = tmp_path / "first"
    outcome: dict = {}

    def first_run() -> None:
        try:
            outcome["summary"] = _train(config, inputs, first_dir, address)
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=first_run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not (first_dir / "metrics.jsonl").exists() or not any(
        "reward_mean" in r for r in read_metrics(first_dir / "metrics.jsonl")
    ):
        assert thread.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.1)
    holder = run_id_of(first_dir)
    with pytest.raises(LeaseRefused, match=f"leased by run '{holder}'"):
        _train(config, inputs, tmp_path / "second", address)
    for call, request in (
        (rollout.Reset, rollout_pb2.RolloutServiceResetRequest()),
        (rollout.UpdateActor, rollout_pb2.UpdateActorRequest(step=99)),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call(request, metadata=call_metadata("rollout"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"leased by run '{holder}'" in refused.value.details()
        assert "naming no run" in refused.value.details()
    critic = critic_pb2_grpc.CriticServiceStub(channel)
    with pytest.raises(grpc.RpcError) as refused:
        critic.Reset(
            critic_pb2.CriticServiceResetRequest(),
            metadata=call_metadata("critic", run_id_metadata("intruder")),
            timeout=30,
        )
    assert "Reset from run 'intruder' refused" in refused.value.details()
    thread.join(timeout=600)
    if "error" in outcome:
        raise outcome["error"]
    assert outcome["summary"].steps == 8

    # released at the run's end: the next run goes ahead at once
    assert _lease_holder(channel, "rollout") == _lease_holder(channel, "critic") == ""
    channel.close()
