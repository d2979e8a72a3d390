"""The reference's Serve deployment: ReferenceService RPCs, thin over ReferenceController.

Each method is named after its RPC: request (the plain API's dataclass, rlserve.core.api,
for ComputeRefLogProb) -> controller (checks, dispatch to the workers) -> response; errors
become gRPC statuses in `batch_rpc` / `rpc_method`.

One replica: data parallelism comes from its workers. The replica reserves no CPU (it
waits on workers); each worker reserves `num_cpus_per_worker`.
"""

from importlib.metadata import version

from ray import serve

from rlserve.core import api
from rlserve.core.auth import server_auth_mode
from rlserve.core.config import settings_json
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
from rlserve.reference.config import ReferenceServiceConfig
from rlserve.reference.controller import controller_for, worker_kwargs
from rlserve.v1 import common_pb2, reference_pb2


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, **HEALTH_CHECK_OPTIONS)
class ReferenceDeployment(ServiceEndpoint):
    """ReferenceService: ComputeRefLogProb, GetInfo."""

    def __init__(self, config: ReferenceServiceConfig):
        self.auth_mode = server_auth_mode(config.auth, "reference")
        setup_replica_tracing("reference", config.tracing)  # before the workers: they inherit it
        self.config = config
        self.controller = controller_for(
            config,
            WorkerGroup.for_service(
                "rlserve.reference.worker:ReferenceWorker", config, worker_kwargs(config)
            ),
        )

    async def check_health(self) -> None:
        """Serve's health check: fails while a worker is dead or the state is unusable."""
        raise_if_unhealthy("reference", self.controller.health_problems())

    @batch_rpc(api.ComputeRefLogProbRequest)
    async def ComputeRefLogProb(self, request: api.ComputeRefLogProbRequest, call: Call):
        log_probs, metrics = await self.controller.compute_ref_log_prob(
            request.batch, call.deadline
        )
        return api.BatchAnswer(log_probs, metrics)

    @rpc_method(reference_pb2.ReferenceServiceGetInfoResponse)
    async def GetInfo(self, request, call: Call):
        raise_if_unhealthy("reference", self.controller.health_problems())
        workers = await self.controller.worker_infos()
        info = common_pb2.ServiceInfo(
            role="reference",
            model=self.config.model_path,
            engine="hf",
            weights_version=0,
            last_applied_step=-1,
            workers=[
                common_pb2.WorkerInfo(
                    rank=w["rank"], node_id=w["node_id"], hostname=w["hostname"], pid=w["pid"]
                )
                for w in workers
            ],
            rlserve_version=version("rlserve-reference"),
            auth_mode=self.auth_mode,
            settings_json=settings_json(self.config),
        )
        return reference_pb2.ReferenceServiceGetInfoResponse(info=info)
