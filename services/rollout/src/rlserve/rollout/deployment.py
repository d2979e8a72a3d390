"""RolloutService as a Ray Serve deployment: protobuf in, plain objects to the controller.

Thin on purpose: each RPC decodes its request (codec; a batch handed in by the in-cluster
handle route, rlserve.core.handle_route, needs no decoding), turns SamplingParams into
SamplingSettings (0 = default, as the proto says), hands everything to the
RolloutController with the caller's deadline, and encodes the answer. `rpc_method` turns
RpcErrors (validation, versions) into gRPC statuses and anything else into a one-line
INTERNAL; the replica keeps serving either way.

One replica, always: it is the service's controller and owns the weights version and
the data-parallel ActorWorkers it creates (Ray actors, fate-shared with the replica).
The replica itself reserves no CPU; the workers reserve `num_cpus_per_worker` each.
"""

from __future__ import annotations

from importlib.metadata import version as package_version

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
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.rollout.controller import RolloutController, controller_settings
from rlserve.rollout.generation import SamplingSettings
from rlserve.rollout.methods import MODEL_LIMITS
from rlserve.v1 import common_pb2, reference_pb2, rollout_pb2

ROLE = "rollout"


def sampling_from_proto(params: rollout_pb2.SamplingParams, return_log_probs: bool):
    """SamplingParams with the proto's defaults applied (top_p 0 = 1, top_k 0 = off, n 0 = 1)."""
    return SamplingSettings(
        temperature=params.temperature,
        top_p=params.top_p if params.top_p != 0 else 1.0,
        top_k=-1 if params.top_k in (0, -1) else params.top_k,
        max_new_tokens=params.max_new_tokens,
        responses_per_prompt=params.responses_per_prompt or 1,
        seed=params.seed if params.HasField("seed") else None,
        ignore_eos=params.ignore_eos,
        return_log_probs=return_log_probs,
    )


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, **HEALTH_CHECK_OPTIONS)
class RolloutDeployment(BatchCalls):
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

    @rpc_method(rollout_pb2.GenerateSequencesResponse)
    async def GenerateSequences(self, request, grpc_context):
        deadline = Deadline.from_metadata(grpc_context.invocation_metadata())
        batch, metrics = await self.controller.generate(
            request_batch(request.prompts, grpc_context),
            sampling_from_proto(request.sampling, request.return_log_probs),
            _optional(request, "expected_weights_version"),
            deadline,
        )
        return rollout_pb2.GenerateSequencesResponse(
            batch=response_batch(batch, grpc_context), metrics=metrics_to_proto(metrics)
        )

    @rpc_method(rollout_pb2.ComputeLogProbResponse)
    async def ComputeLogProb(self, request, grpc_context):
        deadline = Deadline.from_metadata(grpc_context.invocation_metadata())
        batch, metrics = await self.controller.compute_log_prob(
            request_batch(request.batch, grpc_context),
            request.return_entropy,
            _optional(request, "expected_weights_version"),
            deadline,
            return_sum_pi_squared=request.return_sum_pi_squared,
        )
        return rollout_pb2.ComputeLogProbResponse(
            batch=response_batch(batch, grpc_context), metrics=metrics_to_proto(metrics)
        )

    @rpc_method(reference_pb2.ComputeRefLogProbResponse)
    async def ComputeRefLogProb(self, request, grpc_context):
        # ReferenceService's RPC, served here when the reference is merged into the actor
        # (serve_reference): callers address this app with the ReferenceService stub.
        deadline = Deadline.from_metadata(grpc_context.invocation_metadata())
        batch, metrics = await self.controller.compute_ref_log_prob(
            request_batch(request.batch, grpc_context), deadline
        )
        return reference_pb2.ComputeRefLogProbResponse(
            batch=response_batch(batch, grpc_context), metrics=metrics_to_proto(metrics)
        )

    @rpc_method(rollout_pb2.UpdateActorResponse)
    async def UpdateActor(self, request, grpc_context):
        self.lease.check("UpdateActor", grpc_context.invocation_metadata())
        deadline = Deadline.from_metadata(grpc_context.invocation_metadata())
        result = await self.controller.update_actor(
            request.step,
            request.weights_version,
            request_batch(request.batch, grpc_context),
            deadline,
        )
        return rollout_pb2.UpdateActorResponse(
            metrics=metrics_to_proto(result.metrics),
            weights_version=result.weights_version,
            replayed=result.replayed,
            batch=None if result.scores is None else response_batch(result.scores, grpc_context),
        )

    @rpc_method(rollout_pb2.RolloutServiceGetInfoResponse)
    async def GetInfo(self, request, grpc_context):
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
                lease=self._lease_info(),
                settings_json=settings_json(self.config),
            )
        )

    @rpc_method(rollout_pb2.RolloutServiceSaveCheckpointResponse)
    async def SaveCheckpoint(self, request, grpc_context):
        deadline = Deadline.from_metadata(grpc_context.invocation_metadata())
        version, step = await self.controller.save_checkpoint(request.location.path, deadline)
        return rollout_pb2.RolloutServiceSaveCheckpointResponse(
            weights_version=version, last_applied_step=step
        )

    @rpc_method(rollout_pb2.RolloutServiceLoadCheckpointResponse)
    async def LoadCheckpoint(self, request, grpc_context):
        self.lease.check("LoadCheckpoint", grpc_context.invocation_metadata())
        deadline = Deadline.from_metadata(grpc_context.invocation_metadata())
        version, step = await self.controller.load_checkpoint(request.location.path, deadline)
        return rollout_pb2.RolloutServiceLoadCheckpointResponse(
            weights_version=version, last_applied_step=step
        )

    @rpc_method(rollout_pb2.RolloutServiceResetResponse)
    async def Reset(self, request, grpc_context):
        self.lease.check("Reset", grpc_context.invocation_metadata())
        deadline = Deadline.from_metadata(grpc_context.invocation_metadata())
        version, step = await self.controller.reset(deadline)
        return rollout_pb2.RolloutServiceResetResponse(
            weights_version=version, last_applied_step=step
        )

    @rpc_method(rollout_pb2.RolloutServiceLeaseResponse)
    async def Lease(self, request, grpc_context):
        if request.release:
            holder, left = self.lease.release(request.run_id)
        else:
            holder, left = self.lease.take(request.run_id, request.ttl_s)
        return rollout_pb2.RolloutServiceLeaseResponse(
            lease=common_pb2.RunLease(holder=holder, expires_in_s=left)
        )

    def _lease_info(self) -> common_pb2.RunLease:
        holder, left = self.lease.current()
        return common_pb2.RunLease(holder=holder, expires_in_s=left)


def _optional(request, field: str) -> int | None:
    return getattr(request, field) if request.HasField(field) else None
