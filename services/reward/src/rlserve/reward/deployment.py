"""The reward service's Serve deployment: gRPC RewardService methods, kept thin.

ComputeReward: its request (the plain API's dataclass, rlserve.core.api; without a model
kind its columns alone, read without torch) -> `RewardEngine.parse` (checks, errors name
the field) -> `RewardEngine.score` -> the scores as numpy arrays. Errors become gRPC
statuses through `batch_rpc` / `rpc_method`, so a bad request never stops the replica.

One replica = one engine: one pooled HTTP session and concurrency bound, one reward
model copy. The replica takes no GPU; `app.deployment_options` sets its CPUs, replica
count or autoscaling and node placement from the config. GetInfo reports the replica
itself as worker 0 (the reward service has no worker actors), so callers can see which
node it landed on.
"""

from importlib.metadata import PackageNotFoundError, version

from ray import serve

from rlserve.core import api
from rlserve.core.auth import server_auth_mode
from rlserve.core.config import settings_json, validate_config
from rlserve.core.replica_pool import replica_worker_info
from rlserve.core.serving import Call, ServiceEndpoint, batch_rpc, rpc_method, setup_replica_tracing
from rlserve.reward.config import RewardServiceConfig
from rlserve.reward.engine import build_engine
from rlserve.v1 import common_pb2, reward_pb2


def _package_version() -> str:
    try:
        return version("rlserve-reward")
    except PackageNotFoundError:
        return ""


@serve.deployment(ray_actor_options={"num_cpus": 1, "num_gpus": 0})
class RewardDeployment(ServiceEndpoint):
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

    @property
    def reads_tensors(self) -> bool:
        """Whether ComputeReward decodes a gRPC request's tensors (a reward model reads
        them; without one nothing does, and no torch is needed to read the rest)."""
        return self._engine.reads_tensors

    @batch_rpc(api.ComputeRewardRequest)
    async def ComputeReward(
        self, request: api.ComputeRewardRequest, call: Call
    ) -> api.ScoresAnswer:
        inputs = self._engine.parse(request.batch, field="batch")
        result = await self._engine.score(inputs, call.deadline)
        scores = {"scores": result.scores}
        scores.update((f"scores_{name}", s) for name, s in result.kind_scores.items())
        return api.ScoresAnswer(scores, result.metrics, request.batch.meta)

    @rpc_method(reward_pb2.RewardServiceGetInfoResponse)
    async def GetInfo(
        self, request: reward_pb2.RewardServiceGetInfoRequest, call: Call
    ) -> reward_pb2.RewardServiceGetInfoResponse:
        model = self._config.kinds.model
        info = common_pb2.ServiceInfo(
            role="reward",
            model=model.model_path if model else "",
            engine="hf" if model else "",
            weights_version=0,
            last_applied_step=-1,
            workers=[replica_worker_info()],
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
