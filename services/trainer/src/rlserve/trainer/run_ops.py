"""`rlserve run status|stop|checkpoint RUN_DIR`: a running trainer's control service,
reached through what the run writes in its directory when the service starts:
`control_address` (host:port) and `control_token` (the run's token, mode 0600; absent
when the run has none). So a local run, whose token exists only in its own process
environment otherwise, can be watched and stopped from another shell."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

from rlserve.core import auth
from rlserve.v1 import trainer_pb2, trainer_pb2_grpc

ADDRESS_FILE = "control_address"
TOKEN_FILE = "control_token"


def add_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="status, stop or checkpoint of a running trainer")
    run.add_argument("action", choices=["status", "stop", "checkpoint"])
    run.add_argument("run_dir", type=Path, help="the run's directory (runs/<name>/<time>)")
    run.add_argument("--timeout-s", type=float, default=30.0, help="how long the call may take")
    run.add_argument(
        "--no-checkpoint", action="store_true", help="stop: skip the checkpoint at the stop"
    )


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 answered, 1 the run did not answer, 2 the directory names no
    running trainer."""
    address_file = args.run_dir / ADDRESS_FILE
    if not address_file.is_file():
        print(
            f"error: {address_file} does not exist: the run has not started its control "
            "service (trainer.control_port null turns it off) or this is not a run directory",
            file=sys.stderr,
        )
        return 2
    token_file = args.run_dir / TOKEN_FILE
    token = token_file.read_text().strip() if token_file.is_file() else None
    metadata = [(auth.TOKEN_METADATA_KEY, token)] if token else []
    address = address_file.read_text().strip()
    with grpc.insecure_channel(address) as channel:
        trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
        try:
            print(_call(trainer, args, metadata))
        except grpc.RpcError as error:
            print(
                f"error: the trainer at {address} did not answer {args.action}: "
                f"{error.code().name}: {error.details()} (a finished run stops its service)",
                file=sys.stderr,
            )
            return 1
    return 0


def _call(trainer: trainer_pb2_grpc.TrainerServiceStub, args, metadata) -> str:
    timeout = args.timeout_s
    if args.action == "stop":
        request = trainer_pb2.StopRequest(checkpoint=not args.no_checkpoint)
        after = trainer.Stop(request, metadata=metadata, timeout=timeout).after_step
        return f"stopping after step {after}"
    if args.action == "checkpoint":
        request = trainer_pb2.RequestCheckpointRequest()
        after = trainer.RequestCheckpoint(request, metadata=metadata, timeout=timeout).after_step
        return f"checkpoint after step {after}"
    status = trainer.GetStatus(trainer_pb2.GetStatusRequest(), metadata=metadata, timeout=timeout)
    lines = [
        f"{trainer_pb2.RunState.Name(status.state)}: step {status.step} of "
        f"{status.total_steps} ({status.run_dir})"
    ]
    lines += [
        f"  {service.role:<10} {'ok' if service.healthy else 'UNHEALTHY'}  weights "
        f"{service.weights_version}  {service.detail}".rstrip()
        for service in status.services
    ]
    return "\n".join(lines)
