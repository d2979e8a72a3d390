"""The trainer's own gRPC service (rlserve.v1.TrainerService): status, checkpoint, stop.

It runs in the trainer's event loop on its own port (the trainer is a process, not a
Serve replica); requests only set flags that the loop acts on between steps, so a
checkpoint or stop never interrupts a step half-way. GetStatus also asks every service
the run uses for its GetInfo (concurrently, a few seconds at most) and reports each one's
health and weights version. With a token set (rlserve.core.auth), every call must carry
it, as for the services: one without it, or with another, is UNAUTHENTICATED.
"""

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc

from rlserve.core import auth
from rlserve.core.rpc import call_metadata
from rlserve.v1 import (
    critic_pb2,
    reference_pb2,
    reward_pb2,
    rollout_pb2,
    trainer_pb2,
    trainer_pb2_grpc,
)

HEALTH_TIMEOUT_S = 5.0
_INFO_REQUESTS = {
    "rollout": rollout_pb2.RolloutServiceGetInfoRequest,
    "critic": critic_pb2.CriticServiceGetInfoRequest,
    "reference": reference_pb2.ReferenceServiceGetInfoRequest,
    "reward": reward_pb2.RewardServiceGetInfoRequest,
}


@dataclass
class RunControl:
    """State shared between the loop and the control service."""

    state: int = trainer_pb2.RUN_STATE_STARTING
    step: int = 0
    total_steps: int = 0
    run_dir: str = ""
    error: str = ""
    last_metrics: dict[str, float] = field(default_factory=dict)
    services: dict[str, trainer_pb2.ServiceStatus] = field(default_factory=dict)
    checkpoint_requested: bool = False
    stop_requested: bool = False
    checkpoint_on_stop: bool = False
    next_checkpoint_path: str = ""


async def service_info(role: str, client: Any, timeout_s: float = HEALTH_TIMEOUT_S) -> Any:
    """One try of the service's GetInfo (its rlserve.v1.ServiceInfo); raises the
    AioRpcError, or TimeoutError when no answer came within `timeout_s`."""
    response = await asyncio.wait_for(
        client.stub.GetInfo(
            _INFO_REQUESTS[role](),
            metadata=call_metadata(client.application),
            timeout=timeout_s,
        ),
        timeout_s + 1,
    )
    return response.info


def failure_detail(error: BaseException, timeout_s: float = HEALTH_TIMEOUT_S) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"no answer within {timeout_s:g} s"


async def service_status(role: str, client: Any) -> trainer_pb2.ServiceStatus:
    """One service's health from its GetInfo (one try, HEALTH_TIMEOUT_S)."""
    try:
        info = await service_info(role, client)
    except (grpc.aio.AioRpcError, TimeoutError) as error:
        return trainer_pb2.ServiceStatus(role=role, healthy=False, detail=failure_detail(error))
    return trainer_pb2.ServiceStatus(role=role, healthy=True, weights_version=info.weights_version)


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, control: RunControl, clients: dict[str, Any] | None = None):
        self.control = control
        self.clients = clients or {}  # role -> ServiceClient of the services in use

    async def GetStatus(self, request, context):
        control = self.control
        statuses = await asyncio.gather(
            *(service_status(role, client) for role, client in self.clients.items())
        )
        control.services = {status.role: status for status in statuses}
        return trainer_pb2.GetStatusResponse(
            state=control.state,
            step=control.step,
            total_steps=control.total_steps,
            last_metrics=control.last_metrics,
            services=list(control.services.values()),
            run_dir=control.run_dir,
            error=control.error,
        )

    async def RequestCheckpoint(self, request, context):
        self.control.checkpoint_requested = True
        return trainer_pb2.RequestCheckpointResponse(
            after_step=self.control.step + 1, path=self.control.next_checkpoint_path
        )

    async def Stop(self, request, context):
        self.control.stop_requested = True
        self.control.checkpoint_on_stop = request.checkpoint
        if self.control.state == trainer_pb2.RUN_STATE_RUNNING:
            self.control.state = trainer_pb2.RUN_STATE_STOPPING
        return trainer_pb2.StopResponse(after_step=self.control.step + 1)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, before the request is even parsed, a call whose `rlserve-token` does not
    match this process's token (every call passes when the process has none)."""

    async def intercept_service(self, continuation, handler_call_details):
        refused = auth.rejection(handler_call_details.invocation_metadata or ())
        if refused is None:
            return await continuation(handler_call_details)

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refused)

        return grpc.unary_unary_rpc_method_handler(refuse)


async def serve_control(
    control: RunControl, port: int, clients: dict[str, Any] | None = None
) -> tuple[grpc.aio.Server, int]:
    """Starts the control service on 127.0.0.1:port (0 = any); returns (server, port).
    `clients` (role -> ServiceClient) are the services GetStatus reports on."""
    server = grpc.aio.server(interceptors=[TokenInterceptor()])
    servicer = TrainerServicer(control, clients)
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound
