"""The environment service's Serve deployment: EnvironmentService RPCs, thin over
EnvironmentEngine. Errors become gRPC statuses through `rpc_method`; a tool's own
failure is an answer (see rlserve.environment.engine), so the replica keeps serving.

Replicas are interchangeable (a session missing on one is rebuilt there), so Serve may
route any call to any replica and scale them on cheap nodes. GetInfo reports the replica
itself as worker 0, so callers can see which node it landed on.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version

from ray import serve

from rlserve.core.auth import server_auth_mode
from rlserve.core.config import settings_json, validate_config
from rlserve.core.replica_pool import replica_worker_info
from rlserve.core.serving import Call, rpc_method, setup_replica_tracing
from rlserve.core.tracing import span
from rlserve.environment.config import EnvironmentServiceConfig
from rlserve.environment.engine import EnvironmentEngine
from rlserve.v1 import common_pb2, environment_pb2

ROLE = "environment"


def _package_version() -> str:
    try:
        return version("rlserve-environment")
    except PackageNotFoundError:
        return ""


@serve.deployment(ray_actor_options={"num_cpus": 1, "num_gpus": 0})
class EnvironmentDeployment:
    """Serves rlserve.v1.EnvironmentService."""

    def __init__(self, config: dict) -> None:
        # A plain dict crosses to the replica; validating again here keeps one code path.
        self.config = validate_config(EnvironmentServiceConfig, config)
        self.auth_mode = server_auth_mode(self.config.auth, ROLE)
        setup_replica_tracing(ROLE, self.config.tracing)
        self.engine = EnvironmentEngine(self.config)

    @rpc_method(environment_pb2.CallToolResponse)
    async def CallTool(self, request: environment_pb2.CallToolRequest, call: Call):
        # a span per tool call: which tool is slow shows in the trace
        with span(f"environment.tool/{request.tool_name[:64]}", session=request.session_id[:128]):
            answer = await self.engine.call_tool(
                request.session_id,
                request.tool_name,
                request.arguments_json,
                request.tools_kwargs_json,
            )
        return environment_pb2.CallToolResponse(
            observation=answer.observation,
            step_reward=answer.step_reward,
            done=answer.done,
            error=answer.error,
            metrics=answer.metrics,
        )

    @rpc_method(environment_pb2.CloseSessionResponse)
    async def CloseSession(self, request: environment_pb2.CloseSessionRequest, call: Call):
        return environment_pb2.CloseSessionResponse(closed=self.engine.close(request.session_id))

    @rpc_method(environment_pb2.EnvironmentServiceGetInfoResponse)
    async def GetInfo(self, request: environment_pb2.EnvironmentServiceGetInfoRequest, call: Call):
        info = common_pb2.ServiceInfo(
            role=ROLE,
            weights_version=0,
            last_applied_step=-1,
            workers=[replica_worker_info()],
            rlserve_version=_package_version(),
            auth_mode=self.auth_mode,
            settings_json=settings_json(self.config),
        )
        schemas = {name: json.dumps(s) for name, s in self.engine.schemas().items()}
        return environment_pb2.EnvironmentServiceGetInfoResponse(
            info=info, tool_schemas_json=schemas
        )
