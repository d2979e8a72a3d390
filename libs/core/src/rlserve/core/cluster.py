"""Starting Ray and Serve for rlserve: a local cluster, or joining an existing one.

Serve's gRPC proxy serves only the servicers registered when Serve first starts (one
added later is silently UNIMPLEMENTED), so `start_serve` always registers all of
rlserve's services, whichever are deployed now. The proxy binds [::]:port whatever the
host setting says, in plaintext: on a shared network, firewall the gRPC port or run
inside a private network (KubeRay pods). The services check the shared token of
rlserve.core.auth when their processes have one (set before Ray starts here, so every
Ray process inherits it); Ray's own token auth is a separate setting (RAY_AUTH_MODE).
"""

import os
import random
import socket
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import HTTPOptions, ProxyLocation, gRPCOptions

from rlserve.core.message_limits import DEFAULT_LIMIT_BYTES, MESSAGE_LIMIT_ENV

SERVICES = {
    "rollout": "RolloutService",
    "critic": "CriticService",
    "reference": "ReferenceService",
    "reward": "RewardService",
    "environment": "EnvironmentService",
    "trainer": "TrainerService",
}
SERVICER_FUNCTIONS = [
    f"rlserve.v1.{module}_pb2_grpc.add_{service}Servicer_to_server"
    for module, service in SERVICES.items()
]

RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"

# Set before Ray starts (each only where the environment does not set it already):
# - auth off for a cluster whose callers bring no Ray token (the test fixtures'; a local
#   run turns it on first, see use_ray_token_auth); usage stats would try the network;
# - Serve's direct ingress: each app's replica also answers gRPC on a port of its own
#   (DIRECT_GRPC_PORTS), so a client on the cluster (the trainer, see
#   rlserve.core.rpc.direct_grpc_target) skips the proxy's hop, with user code and the
#   router on the replica's event loop (no thread hop per request): a small call took
#   2.7 ms this way against 14.4 ms through the proxy with Serve's defaults. No load
#   balancer stands in front to deregister a stopping replica, so it does not drain for
#   Serve's default 30 s first (a client falls back to the proxy, see ServiceClient).
_RAY_ENV_DEFAULTS = {
    RAY_AUTH_MODE_ENV: "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    # Serve's proxy would otherwise buffer messages of up to 2 GiB before any auth
    MESSAGE_LIMIT_ENV: str(DEFAULT_LIMIT_BYTES),
    # Serve's controller loop (default every 0.1 s) and replicas' metric exports (every
    # 100 ms) are CPU a run pays whether it trains or not: 0.05 cores on the tiny PPO
    # workload, ≈ 4% of its CPU per step. Replica health checks keep their own 10 s period.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# A private local cluster starts no dashboard, so nothing reads what Ray's processes
# otherwise keep producing for it: task events (the state API and the dashboard's task
# views), Prometheus metrics and event-loop statistics. Ray's log monitor also stops
# listing the log directory at every 0.1 s poll (new log files are found within 5 s;
# lines of known files still go out every 0.1 s). Together: 0.02-0.03 cores of Ray's own
# processes, 0.012-0.015 CPU s per step of the tiny PPO workload (≈ 2.5%), measured
# interleaved. Clusters started elsewhere (deploy/ray, KubeRay) keep Ray's defaults.
_LOCAL_RAY_ENV_DEFAULTS = {
    "RAY_enable_task_events": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_event_stats": "0",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
}
DIRECT_GRPC_PORTS = range(40000, 41000)
"""Where Serve's direct ingress puts replicas' own gRPC servers (its default range)."""


def use_ray_token_auth(token: str) -> None:
    """Ray's token auth, with `token`, for the cluster this process starts or joins next:
    set in the environment before Ray starts, so every Ray process inherits both."""
    os.environ[RAY_AUTH_MODE_ENV] = "token"
    os.environ[RAY_AUTH_TOKEN_ENV] = token
    # This process's Ray client read the mode when `ray` was imported: without a reload
    # it would call its own token-auth GCS as 'disabled' and be refused.
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def apply_ray_env_defaults(local: bool = False) -> dict[str, str]:
    """Sets the defaults missing from this process's environment (with `local`, also a
    private local cluster's); returns the values in force, for Ray's processes (a user's
    own setting wins)."""
    defaults = {**_RAY_ENV_DEFAULTS, **(_LOCAL_RAY_ENV_DEFAULTS if local else {})}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in defaults}


def free_port() -> int:
    """A TCP port nothing listens on right now (loopback)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_local_ray(
    num_cpus: int | None = None,
    temp_dir: Path | None = None,
    resources: dict[str, float] | None = None,
    object_store_bytes: int | None = None,
    log_to_driver: bool = True,
) -> None:
    """A private single-node Ray (never touches another Ray running on the machine)."""
    env_vars = apply_ray_env_defaults(local=True)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        resources=resources,
        object_store_memory=object_store_bytes,
        include_dashboard=False,
        _temp_dir=str(temp_dir) if temp_dir else None,
        log_to_driver=log_to_driver,
        runtime_env={"env_vars": env_vars},
    )


def connect_ray(address: str, log_to_driver: bool = True) -> None:
    """Joins an existing cluster ('auto', 'ray://host:10001' or 'host:6379')."""
    apply_ray_env_defaults()
    ray.init(address=address, log_to_driver=log_to_driver)


# Local clusters' Serve ports come from here: above Ray's worker ports (10002-19999) and
# below the kernel's ephemeral range, where Ray's own processes keep binding ports while
# they start (a port probed free there was once taken before Serve's proxy bound it).
LOCAL_SERVE_PORTS = range(20000, 32768)
_SERVE_START_ATTEMPTS = 5


def start_serve_on_a_free_port() -> int:
    """Starts Serve on a free port of LOCAL_SERVE_PORTS, trying another one when the
    proxy cannot bind its pick; returns the gRPC port."""
    for attempt in range(_SERVE_START_ATTEMPTS):
        port = _free_port_in(LOCAL_SERVE_PORTS)
        try:
            start_serve(port, http_port=_free_port_in(LOCAL_SERVE_PORTS))
            return port
        except Exception as error:
            if "Failed to bind" not in str(error) or attempt == _SERVE_START_ATTEMPTS - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def _free_port_in(ports: range) -> int:
    for _ in range(100):
        port = random.choice(ports)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


def start_serve(grpc_port: int, http_port: int | None = None) -> None:
    """Starts Serve (or attaches to it) with every rlserve servicer on one gRPC port."""
    serve.start(
        proxy_location=ProxyLocation.HeadOnly,
        http_options=HTTPOptions(host="127.0.0.1", port=http_port or free_port()),
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS),
    )
