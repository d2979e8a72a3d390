"""The reward service's Serve deployment: gRPC RewardService methods, kept thin.

Each method: proto -> Batch (codec, or the Batch itself by the in-cluster handle route,
rlserve.core.handle_route) -> `RewardEngine.parse` (checks, errors name the
field) -> `RewardEngine.score` -> proto. Errors become gRPC statuses through
`rpc_method`, so a bad request never stops the replica.

One replica = one engine: one pooled HTTP session and concurrency bound, one reward
model copy. The replica takes no GPU; `app.deployment_options` sets its CPUs, replica
count or autoscaling and node placement from the config. GetInfo reports the replica
itself as worker 0 (the reward service has no worker actors), so callers can see which
node it landed on.
"""

import os
import socket
from importlib.metadata import PackageNotFoundError, version

import ray
from ray import serve

from rlserve.core.auth import server_auth_mode
from rlserve.core.config import settings_json, validate_config
from rlserve.core.handle_route import BatchCalls, request_batch, request_columns, response_arrays
from rlserve.core.serving import Deadline, rpc_method, setup_replica_tracing
from rlserve.core.wire import metrics_to_proto
from rlserve.reward.config import RewardServiceConfig
from rlserve.reward.engine import build_engine
from rlserve.v1 import common_pb2, reward_pb2


def _package_version() -> str:
    try:
        return version("rlserve-reward")
    except PackageNotFoundError:
        return ""


@serve.deployment(ray_actor_options={"num_cpus": 1, "num_gpus": 0})
class RewardDeployment(BatchCalls):
    """Serves rlserve.v1.RewardService."""

    def __init__(self, config: dict) -> None:
        # A plain dict crosses to the replica; validating again here keeps one code path.
        self._config = validate_config(RewardServiceConfig, config)
        self.auth_mode = server_auth_mode(self._config.auth, "reward")
        setup_replica_tracing("reward", self._config.tracing)
        if self._config.kinds.model is not None:
            import torch  # a rule or HTTP replica may have none (rlserve-reward[model] does)

            torch.set_num_threads(self._config.torch_threads)
        self._engine = build_engine(self._config)

    @rpc_method(reward_pb2.ComputeRewardResponse)
    async def ComputeReward(
        self, request: reward_pb2.ComputeRewardRequest, grpc_context
    ) -> reward_pb2.ComputeRewardResponse:
        deadline = Deadline.from_metadata(grpc_context.invocation_metadata())
        # Without a model kind nothing reads the tensors: no torch needed to read the rest.
        read = request_batch if self._engine.reads_tensors else request_columns
        batch = read(request.batch, grpc_context)
        inputs = self._engine.parse(batch, field="batch")
        result = await self._engine.score(inputs, deadline)
        scores = {"scores": result.scores}
        scores.update((f"scores_{name}", s) for name, s in result.kind_scores.items())
        return reward_pb2.ComputeRewardResponse(
            batch=response_arrays(scores, batch.meta, grpc_context),
            metrics=metrics_to_proto(result.metrics),
        )

    @rpc_method(reward_pb2.RewardServiceGetInfoResponse)
    async def GetInfo(
        self, request: reward_pb2.RewardServiceGetInfoRequest, grpc_context
    ) -> reward_pb2.RewardServiceGetInfoResponse:
        model = self._config.kinds.model
        info = common_pb2.ServiceInfo(
            role="reward",
            model=model.model_path if model else "",
            engine="hf" if model else "",
            weights_version=0,
            last_applied_step=-1,
            workers=[
                common_pb2.WorkerInfo(
                    rank=0,
                    node_id=ray.get_runtime_context().get_node_id(),
                    hostname=socket.gethostname(),
                    pid=os.getpid(),
                )
            ],
            rlserve_version=_package_version(),
            auth_mode=self.auth_mode,
            settings_json=settings_json(self._config),
        )
        return reward_pb2.RewardServiceGetInfoResponse(
            info=info, kind_weights=self._engine.kind_weights
        )

    async def __del__(self) -> None:
        # Serve awaits an async __del__ on replica shutdown: close pooled connections.
        engine = getattr(self, "_engine", None)
        if engine is not None:
            await engine.close()
