"""The trainer's own gRPC service (rlserve.v1.TrainerService): status, checkpoint, stop.

It runs in the trainer's event loop on its own port (the trainer is a process, not a
Serve replica); requests only set flags that the loop acts on between steps, so a
checkpoint or stop never interrupts a step half-way.
"""

from dataclasses import dataclass, field

import grpc

from rlserve.v1 import trainer_pb2, trainer_pb2_grpc


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


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, control: RunControl):
        self.control = control

    async def GetStatus(self, request, context):
        control = self.control
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


async def serve_control(control: RunControl, port: int) -> tuple[grpc.aio.Server, int]:
    """Starts the control service on 127.0.0.1:port (0 = any); returns (server, port)."""
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(control), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound
