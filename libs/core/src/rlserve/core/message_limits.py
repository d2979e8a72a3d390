"""The largest gRPC message each port accepts, so that an oversized request is refused
from its 5-byte length prefix (RESOURCE_EXHAUSTED), before any of it is buffered and
before the token is checked.

Serve's gRPC proxy and every replica's own (direct-ingress) gRPC server read their bound
from RAY_SERVE_GRPC_MAX_MESSAGE_SIZE when their process starts; Serve's default is 2 GiB,
so eight unauthenticated 1 GiB requests held 8 GiB of a node. A stateful service's
replica gets the bound its `max_request_tokens` allows (every tensor of its largest
legitimate request or answer, at 8 bytes per element, is well under BYTES_PER_TOKEN per
token position); the proxy, shared by every service, gets the largest of the run's.
Batches sent through a DeploymentHandle (rlserve.core.serving.ServiceEndpoint) travel through Ray's
object store and are not bounded here: only cluster members with Ray's token reach it.
"""

from __future__ import annotations

from typing import Any

MESSAGE_LIMIT_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
BYTES_PER_TOKEN = 96
"""An UpdateActor batch (the largest per token position) carries four int64 sequence
tensors and up to four float32 per-token tensors: 48 bytes; twice that is the bound."""
OVERHEAD_BYTES = 4 * 2**20
"""Protobuf framing, metadata, metrics and non-tensor fields."""
REWARD_LIMIT_BYTES = 64 * 2**20
"""The reward service's bound: its requests are texts (responses and ground truths),
with no token count of their own to size them by."""
ENVIRONMENT_LIMIT_BYTES = OVERHEAD_BYTES
"""The environment service's bound: one tool call's arguments and the row's tool
arguments (each at most its max_arguments_chars of text) and one observation."""
DEFAULT_MAX_REQUEST_TOKENS = 262_144
"""The services' default max_request_tokens (what a cluster rlserve starts bounds the
proxy for when nothing bigger was asked for)."""


def message_limit_bytes(max_request_tokens: int) -> int:
    """The gRPC message bound of a service whose requests hold at most this many token
    positions (capped at gRPC's own maximum)."""
    return min(max_request_tokens * BYTES_PER_TOKEN + OVERHEAD_BYTES, 2**31 - 1)


DEFAULT_LIMIT_BYTES = max(message_limit_bytes(DEFAULT_MAX_REQUEST_TOKENS), REWARD_LIMIT_BYTES)


def with_message_limit(ray_actor_options: dict[str, Any], limit_bytes: int) -> dict[str, Any]:
    """`ray_actor_options` whose replica process bounds its gRPC server at `limit_bytes`."""
    options = dict(ray_actor_options)
    runtime_env = dict(options.get("runtime_env") or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars[MESSAGE_LIMIT_ENV] = str(limit_bytes)
    runtime_env["env_vars"] = env_vars
    options["runtime_env"] = runtime_env
    return options


def bounded(deployment: Any, max_request_tokens: int) -> Any:
    """A Serve deployment whose replicas bound their gRPC server for requests of at most
    `max_request_tokens` token positions."""
    return deployment.options(
        ray_actor_options=with_message_limit(
            deployment.ray_actor_options or {}, message_limit_bytes(max_request_tokens)
        )
    )
