"""The critic's Serve deployment: CriticService RPCs, thin over CriticController.

Each method is named after its RPC and does: protobuf -> Batch (codec, or the Batch itself
by the in-cluster handle route, rlserve.core.handle_route) -> controller (checks, dispatch
to the worker group) -> protobuf. Errors become gRPC statuses in
`rpc_method`; the caller's deadline comes from the `rlserve-deadline-unix-s` metadata.

One replica only: the replica is the service's controller and holds its state (weights
version, applied steps); data parallelism comes from its workers, not from replicas.
The replica itself reserves no CPU (it waits on workers); each worker reserves
`num_cpus_per_worker`.
"""

from importlib.metadata import version

from ray import serve

from rlserve.core.auth import server_auth_mode
from rlserve.core.config import settings_json
from rlserve.core.handle_route import BatchCalls, request_batch, response_batch
from rlserve.core.lease import RunLease
from rlserve.core.serving import (
    HEALTH_CHECK_OPTIONS,
    Deadline,
    raise_if_unhealthy,
    rpc_method,
    setup_replica_tracing,
)
from rlserve.core.wire import metrics_to_proto
from rlserve.core.workers import WorkerGroup
from rlserve.critic.config import CriticServiceConfig
from rlserve.critic.controller import controller_for, worker_kwargs
from rlserve.v1 import common_pb2, critic_pb2


def _deadline(grpc_context) -> Deadline:
    return Deadline.from_metadata(grpc_context.invocation_metadata())


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, **HEALTH_CHECK_OPTIONS)
class CriticDeployment(BatchCalls):
    """CriticService: ComputeValues, UpdateCritic, GetInfo, Save/LoadCheckpoint, Reset."""

    def __init__(self, config: CriticServiceConfig):
        self.auth_mode = server_auth_mode(config.auth, "critic")
        self.lease = RunLease("critic")
        setup_replica_tracing("critic", config.tracing)  # before the workers: they inherit it
        self.config = config
        self.controller = controller_for(
            config,
            WorkerGroup.for_service(
                "rlserve.critic.worker:CriticWorker", config, worker_kwargs(config)
            ),
        )

    async def check_health(self) -> None:
        """Serve's health check: fails while a worker is dead or the state is unusable."""
        raise_if_unhealthy("critic", self.controller.health_problems())

    @rpc_method(critic_pb2.ComputeValuesResponse)
    async def ComputeValues(self, request, grpc_context):
        batch = request_batch(request.batch, grpc_context)
        values, metrics = await self.controller.compute_values(batch, _deadline(grpc_context))
        return critic_pb2.ComputeValuesResponse(
            batch=response_batch(values, grpc_context), metrics=metrics_to_proto(metrics)
        )

    @rpc_method(critic_pb2.UpdateCriticResponse)
    async def UpdateCritic(self, request, grpc_context):
        self.lease.check("UpdateCritic", grpc_context.invocation_metadata())
        batch = request_batch(request.batch, grpc_context)
        metrics, weights_version, replayed = await self.controller.update_critic(
            request.step, batch, _deadline(grpc_context)
        )
        return critic_pb2.UpdateCriticResponse(
            metrics=metrics_to_proto(metrics), weights_version=weights_version, replayed=replayed
        )

    @rpc_method(critic_pb2.CriticServiceGetInfoResponse)
    async def GetInfo(self, request, grpc_context):
        raise_if_unhealthy("critic", self.controller.health_problems())
        workers = await self.controller.worker_infos()
        info = common_pb2.ServiceInfo(
            role="critic",
            model=self.config.model_path,
            engine="deepspeed",
            weights_version=self.controller.weights_version,
            last_applied_step=self.controller.last_applied_step,
            workers=[
                common_pb2.WorkerInfo(
                    rank=w["rank"], node_id=w["node_id"], hostname=w["hostname"], pid=w["pid"]
                )
                for w in workers
            ],
            rlserve_version=version("rlserve-critic"),
            auth_mode=self.auth_mode,
            lease=self._lease_info(),
            settings_json=settings_json(self.config),
        )
        return critic_pb2.CriticServiceGetInfoResponse(info=info)

    @rpc_method(critic_pb2.CriticServiceSaveCheckpointResponse)
    async def SaveCheckpoint(self, request, grpc_context):
        weights_version, step = await self.controller.save_checkpoint(
            request.location.path, _deadline(grpc_context)
        )
        return critic_pb2.CriticServiceSaveCheckpointResponse(
            weights_version=weights_version, last_applied_step=step
        )

    @rpc_method(critic_pb2.CriticServiceLoadCheckpointResponse)
    async def LoadCheckpoint(self, request, grpc_context):
        self.lease.check("LoadCheckpoint", grpc_context.invocation_metadata())
        weights_version, step = await self.controller.load_checkpoint(
            request.location.path, _deadline(grpc_context)
        )
        return critic_pb2.CriticServiceLoadCheckpointResponse(
            weights_version=weights_version, last_applied_step=step
        )

    @rpc_method(critic_pb2.CriticServiceResetResponse)
    async def Reset(self, request, grpc_context):
        self.lease.check("Reset", grpc_context.invocation_metadata())
        weights_version, step = await self.controller.reset(_deadline(grpc_context))
        return critic_pb2.CriticServiceResetResponse(
            weights_version=weights_version, last_applied_step=step
        )

    @rpc_method(critic_pb2.CriticServiceLeaseResponse)
    async def Lease(self, request, grpc_context):
        if request.release:
            holder, left = self.lease.release(request.run_id)
        else:
            holder, left = self.lease.take(request.run_id, request.ttl_s)
        return critic_pb2.CriticServiceLeaseResponse(
            lease=common_pb2.RunLease(holder=holder, expires_in_s=left)
        )

    def _lease_info(self) -> common_pb2.RunLease:
        holder, left = self.lease.current()
        return common_pb2.RunLease(holder=holder, expires_in_s=left)
