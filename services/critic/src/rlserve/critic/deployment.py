"""The critic's Serve deployment: CriticService RPCs, thin over CriticController.

Each method is named after its RPC and does: request (the plain API's dataclass,
rlserve.core.api, for the batch RPCs) -> controller (checks, dispatch to the worker
group) -> response. Errors become gRPC statuses in `batch_rpc` / `rpc_method`; the
caller's deadline comes from the `rlserve-deadline-unix-s` metadata.

One replica only: the replica is the service's controller and holds its state (weights
version, applied steps); data parallelism comes from its workers, not from replicas.
The replica itself reserves no CPU (it waits on workers); each worker reserves
`num_cpus_per_worker`.
"""

from importlib.metadata import version

from ray import serve

from rlserve.core import api
from rlserve.core.auth import server_auth_mode
from rlserve.core.config import settings_json
from rlserve.core.lease import RunLease
from rlserve.core.serving import (
    HEALTH_CHECK_OPTIONS,
    Call,
    ServiceEndpoint,
    batch_rpc,
    raise_if_unhealthy,
    rpc_method,
    setup_replica_tracing,
)
from rlserve.core.workers import WorkerGroup
from rlserve.critic.config import CriticServiceConfig
from rlserve.critic.controller import controller_for, worker_kwargs
from rlserve.v1 import common_pb2, critic_pb2


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, **HEALTH_CHECK_OPTIONS)
class CriticDeployment(ServiceEndpoint):
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

    @batch_rpc(api.ComputeValuesRequest)
    async def ComputeValues(self, request: api.ComputeValuesRequest, call: Call):
        values, metrics = await self.controller.compute_values(request.batch, call.deadline)
        return api.BatchAnswer(values, metrics)

    @batch_rpc(api.UpdateCriticRequest)
    async def UpdateCritic(self, request: api.UpdateCriticRequest, call: Call):
        self.lease.check("UpdateCritic", call.metadata)
        metrics, weights_version, replayed = await self.controller.update_critic(
            request.step, request.batch, call.deadline
        )
        return api.UpdateAnswer(metrics, weights_version, replayed)

    @rpc_method(critic_pb2.CriticServiceGetInfoResponse)
    async def GetInfo(self, request, call: Call):
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
            lease=self.lease.info(),
            settings_json=settings_json(self.config),
        )
        return critic_pb2.CriticServiceGetInfoResponse(info=info)

    @rpc_method(critic_pb2.CriticServiceSaveCheckpointResponse)
    async def SaveCheckpoint(self, request, call: Call):
        weights_version, step = await self.controller.save_checkpoint(
            request.location.path, call.deadline
        )
        return critic_pb2.CriticServiceSaveCheckpointResponse(
            weights_version=weights_version, last_applied_step=step
        )

    @rpc_method(critic_pb2.CriticServiceLoadCheckpointResponse)
    async def LoadCheckpoint(self, request, call: Call):
        self.lease.check("LoadCheckpoint", call.metadata)
        weights_version, step = await self.controller.load_checkpoint(
            request.location.path, call.deadline
        )
        return critic_pb2.CriticServiceLoadCheckpointResponse(
            weights_version=weights_version, last_applied_step=step
        )

    @rpc_method(critic_pb2.CriticServiceResetResponse)
    async def Reset(self, request, call: Call):
        self.lease.check("Reset", call.metadata)
        weights_version, step = await self.controller.reset(call.deadline)
        return critic_pb2.CriticServiceResetResponse(
            weights_version=weights_version, last_applied_step=step
        )

    @rpc_method(critic_pb2.CriticServiceLeaseResponse)
    async def Lease(self, request, call: Call):
        return critic_pb2.CriticServiceLeaseResponse(lease=self.lease.answer(request))
