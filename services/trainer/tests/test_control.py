"""The trainer's control service over real gRPC: Stop and RequestCheckpoint set the flags
the loop honours, and GetStatus reports a service that does not answer as unhealthy with
the reason (the healthy path runs in integration_tests/test_live_redeploy.py). With a
token set, a call without it or with another one is UNAUTHENTICATED and changes nothing."""

import asyncio

import grpc
import pytest

from rlserve.core import auth
from rlserve.core.cluster import free_port
from rlserve.core.rpc import ServiceClient, call_metadata, open_channel
from rlserve.trainer.control import RunControl, serve_control
from rlserve.v1 import reward_pb2_grpc, trainer_pb2, trainer_pb2_grpc


async def _exercise() -> tuple[RunControl, trainer_pb2.GetStatusResponse, int, int]:
    nobody = open_channel(f"127.0.0.1:{free_port()}")  # nothing listens there
    reward = ServiceClient(
        nobody, reward_pb2_grpc.RewardServiceStub, "reward", timeout_s=2, direct=False
    )
    control = RunControl(state=trainer_pb2.RUN_STATE_RUNNING, step=3, total_steps=10)
    server, port = await serve_control(control, 0, {"reward": reward})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
        status = await trainer.GetStatus(
            trainer_pb2.GetStatusRequest(), metadata=call_metadata(None), timeout=30
        )
        checkpoint = await trainer.RequestCheckpoint(
            trainer_pb2.RequestCheckpointRequest(), metadata=call_metadata(None), timeout=10
        )
        stop = await trainer.Stop(
            trainer_pb2.StopRequest(checkpoint=True), metadata=call_metadata(None), timeout=10
        )
    await server.stop(None)
    await nobody.close()
    return control, status, checkpoint.after_step, stop.after_step


def test_control_service_sets_flags_and_reports_an_unreachable_service():
    control, status, checkpoint_after, stop_after = asyncio.run(_exercise())
    assert status.step == 3 and status.total_steps == 10
    assert status.state == trainer_pb2.RUN_STATE_RUNNING
    [reward] = status.services
    assert reward.role == "reward" and not reward.healthy
    assert reward.detail.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")), reward.detail
    assert checkpoint_after == 4 and stop_after == 4
    assert control.checkpoint_requested and control.stop_requested and control.checkpoint_on_stop
    assert control.state == trainer_pb2.RUN_STATE_STOPPING


async def _stop_with(metadata: list[tuple[str, str]]) -> tuple[RunControl, grpc.aio.AioRpcError]:
    control = RunControl(state=trainer_pb2.RUN_STATE_RUNNING, step=3, total_steps=10)
    server, port = await serve_control(control, 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await trainer.Stop(trainer_pb2.StopRequest(), metadata=metadata, timeout=10)
            assert not control.stop_requested  # refused before the servicer ran
            # The service keeps answering a call that carries the token.
            status = await trainer.GetStatus(
                trainer_pb2.GetStatusRequest(), metadata=call_metadata(None), timeout=10
            )
            assert status.step == 3
    finally:
        await server.stop(None)
    return control, refused.value


@pytest.mark.parametrize("sent", [None, "not-the-token"], ids=["no-token", "wrong-token"])
def test_control_service_refuses_a_call_without_the_token(monkeypatch, sent):
    token = auth.generate_token()
    monkeypatch.setenv(auth.TOKEN_ENV, token)
    metadata = [] if sent is None else [(auth.TOKEN_METADATA_KEY, sent)]
    control, error = asyncio.run(_stop_with(metadata))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert auth.TOKEN_METADATA_KEY in error.details() and auth.TOKEN_ENV in error.details()
    assert token not in error.details() and "not-the-token" not in error.details()
    assert control.state == trainer_pb2.RUN_STATE_RUNNING


async def _run_commands(run_dir, commands: list[list[str]]) -> tuple[RunControl, list[int]]:
    """Each `rlserve run ...` command against a live control service, from a thread (the
    CLI blocks; the service answers on this loop)."""
    from rlserve.trainer import cli

    control = RunControl(state=trainer_pb2.RUN_STATE_RUNNING, step=3, total_steps=10)
    server, port = await serve_control(control, 0)
    (run_dir / "control_address").write_text(f"127.0.0.1:{port}\n")
    try:
        codes = [await asyncio.to_thread(cli.main, command) for command in commands]
    finally:
        await server.stop(None)
    return control, codes


def test_run_commands_reach_a_running_trainer_with_the_token_its_directory_holds(
    tmp_path, monkeypatch, capsys
):
    import os
    import stat

    from rlserve.trainer.run import write_private

    monkeypatch.setenv(auth.TOKEN_ENV, "run-token")  # the trainer's, as a run has it
    write_private(tmp_path / "control_token", "run-token\n")
    assert stat.S_IMODE(os.stat(tmp_path / "control_token").st_mode) == 0o600
    commands = [["run", action, str(tmp_path)] for action in ("status", "checkpoint", "stop")]
    control, codes = asyncio.run(_run_commands(tmp_path, commands))
    assert codes == [0, 0, 0]
    out = capsys.readouterr().out
    assert "RUN_STATE_RUNNING: step 3 of 10" in out and "stopping after step 4" in out
    assert control.stop_requested and control.checkpoint_requested and control.checkpoint_on_stop
    # without the token file the trainer refuses, and the command says so
    (tmp_path / "control_token").unlink()
    control, codes = asyncio.run(_run_commands(tmp_path, [["run", "stop", str(tmp_path)]]))
    assert codes == [1] and not control.stop_requested
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_run_commands_name_a_directory_without_a_running_trainer(tmp_path, capsys):
    from rlserve.trainer import cli

    assert cli.main(["run", "status", str(tmp_path)]) == 2
    assert "control_address does not exist" in capsys.readouterr().err
