"""RolloutService as a Ray Serve deployment: the plain API in, plain objects to the controller.

Thin on purpose: each batch RPC takes its request dataclass (rlserve.core.api: decoded
from protobuf by `batch_rpc` on gRPC, handed in as is by the in-cluster handle route),
hands it to the RolloutController with the caller's deadline, and answers the response
dataclass. `batch_rpc` and `rpc_method` turn
RpcErrors (validation, versions) into gRPC statuses and anything else into a one-line
INTERNAL; the replica keeps serving either way.

One replica, always: it is the service's controller and owns the weights version and
the data-parallel ActorWorkers it creates (Ray actors, fate-shared with the replica).
The replica itself reserves no CPU; the workers reserve `num_cpus_per_worker` each.
"""

from __future__ import annotations

from dataclasses import asdict
from importlib.metadata import version as package_version

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
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.rollout.controller import RolloutController, controller_settings
from rlserve.rollout.generation import SamplingSettings
from rlserve.rollout.methods import MODEL_LIMITS
from rlserve.v1 import common_pb2, reference_pb2, rollout_pb2

ROLE = "rollout"


def sampling_settings(sampling: api.Sampling, return_log_probs: bool) -> SamplingSettings:
    return SamplingSettings(**asdict(sampling), return_log_probs=return_log_probs)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, **HEALTH_CHECK_OPTIONS)
class RolloutDeployment(ServiceEndpoint):
    """The actor service: generation, log-probs and PPO updates over DP ActorWorkers."""

    def __init__(self, config: RolloutServiceConfig):
        self.auth_mode = server_auth_mode(config.auth, ROLE)
        self.lease = RunLease(ROLE)
        setup_replica_tracing(ROLE, config.tracing)  # before the workers: they inherit it
        self.config = config
        workers = WorkerGroup.for_service(
            "rlserve.rollout.worker:ActorWorker.from_service_config", config, {"config": config}
        )
        limits = workers.call_rank0(MODEL_LIMITS)
        self.controller = RolloutController(workers, controller_settings(config, **limits))

    async def check_health(self) -> None:
        """Serve's health check: fails while a worker is dead or the state is unusable."""
        raise_if_unhealthy("rollout", self.controller.health_problems())

    @batch_rpc(api.GenerateSequencesRequest)
    async def GenerateSequences(self, request: api.GenerateSequencesRequest, call: Call):
        batch, metrics = await self.controller.generate(
            request.prompts,
            sampling_settings(request.sampling, request.return_log_probs),
            request.expected_weights_version,
            call.deadline,
            request.agent,
        )
        return api.BatchAnswer(batch, metrics)

    @batch_rpc(api.ComputeLogProbRequest)
    async def ComputeLogProb(self, request: api.ComputeLogProbRequest, call: Call):
        batch, metrics = await self.controller.compute_log_prob(
            request.batch,
            request.return_entropy,
            request.expected_weights_version,
            call.deadline,
            return_sum_pi_squared=request.return_sum_pi_squared,
        )
        return api.BatchAnswer(batch, metrics)

    @batch_rpc(api.ComputeRefLogProbRequest)
    async def ComputeRefLogProb(self, request: api.ComputeRefLogProbRequest, call: Call):
        # ReferenceService's RPC, served here when the reference is merged into the actor
        # (serve_reference): callers address this app with the ReferenceService stub.
        batch, metrics = await self.controller.compute_ref_log_prob(request.batch, call.deadline)
        return api.BatchAnswer(batch, metrics)

    @batch_rpc(api.UpdateActorRequest)
    async def UpdateActor(self, request: api.UpdateActorRequest, call: Call):
        self.lease.check("UpdateActor", call.metadata)
        result = await self.controller.update_actor(
            request.step, request.weights_version, request.batch, call.deadline
        )
        return api.UpdateAnswer(
            result.metrics, result.weights_version, result.replayed, result.scores
        )

    @rpc_method(rollout_pb2.RolloutServiceGetInfoResponse)
    async def GetInfo(self, request, call: Call):
        # Serve routes by method name, so ReferenceService.GetInfo (merged reference)
        # arrives here too; answer in the type the caller's stub expects.
        response_cls = (
            reference_pb2.ReferenceServiceGetInfoResponse
            if isinstance(request, reference_pb2.ReferenceServiceGetInfoRequest)
            else rollout_pb2.RolloutServiceGetInfoResponse
        )
        raise_if_unhealthy("rollout", self.controller.health_problems())
        info = await self.controller.info()
        return response_cls(
            info=common_pb2.ServiceInfo(
                role=ROLE,
                model=info["model"],
                engine=info["engine"],
                weights_version=info["weights_version"],
                last_applied_step=info["last_applied_step"],
                workers=[common_pb2.WorkerInfo(**worker) for worker in info["workers"]],
                rlserve_version=package_version("rlserve-rollout"),
                auth_mode=self.auth_mode,
                lease=self.lease.info(),
                settings_json=settings_json(self.config),
            )
        )

    @rpc_method(rollout_pb2.RolloutServiceSaveCheckpointResponse)
    async def SaveCheckpoint(self, request, call: Call):
        version, step = await self.controller.save_checkpoint(request.location.path, call.deadline)
        return rollout_pb2.RolloutServiceSaveCheckpointResponse(
            weights_version=version, last_applied_step=step
        )

    @rpc_method(rollout_pb2.RolloutServiceLoadCheckpointResponse)
    async def LoadCheckpoint(self, request, call: Call):
        self.lease.check("LoadCheckpoint", call.metadata)
        version, step = await self.controller.load_checkpoint(request.location.path, call.deadline)
        return rollout_pb2.RolloutServiceLoadCheckpointResponse(
            weights_version=version, last_applied_step=step
        )

    @rpc_method(rollout_pb2.RolloutServiceResetResponse)
    async def Reset(self, request, call: Call):
        self.lease.check("Reset", call.metadata)
        version, step = await self.controller.reset(call.deadline)
        return rollout_pb2.RolloutServiceResetResponse(
            weights_version=version, last_applied_step=step
        )

    @rpc_method(rollout_pb2.RolloutServiceLeaseResponse)
    async def Lease(self, request, call: Call):
        return rollout_pb2.RolloutServiceLeaseResponse(lease=self.lease.answer(request))
