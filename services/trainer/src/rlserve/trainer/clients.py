"""The trainer's clients of the four services, one per role the run uses.

Every client shares one channel to Serve's gRPC proxy, the run's deadline
(trainer.rpc_timeout_s) and retry policy (trainer.rpc_retries); with trainer.call_routes
'cluster' a client also calls replicas directly or hands large batches through Ray's
object store (docs/architecture.md, "How calls reach a service").
"""

from collections import Counter
from dataclasses import dataclass

from rlserve.core.rpc import RetryPolicy, ServiceClient, open_channel
from rlserve.core.run_config import RunConfig
from rlserve.trainer.deploy import reference_application
from rlserve.v1 import (
    critic_pb2_grpc,
    reference_pb2_grpc,
    reward_pb2_grpc,
    rollout_pb2_grpc,
)


@dataclass
class Clients:
    rollout: ServiceClient
    reward: ServiceClient
    reference: ServiceClient | None
    critic: ServiceClient | None

    @classmethod
    def connect(
        cls, address: str, config: RunConfig, roles: set[str], run_id: str = ""
    ) -> "Clients":
        channel = open_channel(address)
        policy = RetryPolicy(retries=config.trainer.rpc_retries)
        timeout_s = config.trainer.rpc_timeout_s
        on_cluster_routes = config.trainer.call_routes == "cluster"

        def client(stub_cls: type, app: str | None) -> ServiceClient | None:
            if app is None or app not in roles:
                return None
            return ServiceClient(
                channel,
                stub_cls,
                app,
                timeout_s,
                policy,
                direct=on_cluster_routes,
                handle=on_cluster_routes,
                handle_min_bytes=config.trainer.handle_route_min_bytes,
                run_id=run_id,
            )

        # the rollout app itself answers ReferenceService when the reference is merged
        reference_app = reference_application(config)
        return cls(
            rollout=client(rollout_pb2_grpc.RolloutServiceStub, "rollout"),
            reward=client(reward_pb2_grpc.RewardServiceStub, "reward"),
            reference=client(reference_pb2_grpc.ReferenceServiceStub, reference_app),
            critic=client(critic_pb2_grpc.CriticServiceStub, "critic"),
        )

    def calls_by_route(self) -> dict[str, int]:
        """Calls answered so far over all clients, by route (handle, direct, proxy)."""
        total: Counter[str] = Counter()
        for client in (self.rollout, self.reward, self.reference, self.critic):
            if client is not None:
                total.update(client.calls_by_route)
        return dict(sorted(total.items()))

    async def close(self) -> None:
        """Closes the clients' direct channels to the replicas."""
        for client in (self.rollout, self.reward, self.reference, self.critic):
            if client is not None:
                await client.close()
