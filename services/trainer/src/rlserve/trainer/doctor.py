"""`rlserve doctor`: one look at a running cluster's services.

For every Serve app: Serve's status, the service's own answer to GetInfo (health, how
it checks callers (token, or none when deployed with auth: none), weights version,
last applied step; through the gRPC proxy with the cluster's token,
one try within --timeout-s), and each of its processes — replicas and their workers —
with node, pid and resident memory, measured from outside (rlserve.core.resources) so
that a busy or hung replica is measured too; then the object store's use. Exit status 1
when an app is not RUNNING or a GetInfo failed, so it doubles as a probe for scripts.
"""

import argparse
import asyncio
from dataclasses import dataclass, field

import grpc

from rlserve.core import placement
from rlserve.core.resources import ObjectStoreUse, ProcessMemory, object_store_use, service_memory
from rlserve.core.rpc import ServiceClient, open_channel
from rlserve.trainer.control import failure_detail, service_info
from rlserve.v1 import critic_pb2_grpc, reference_pb2_grpc, reward_pb2_grpc, rollout_pb2_grpc

STUBS = {
    "rollout": rollout_pb2_grpc.RolloutServiceStub,
    "critic": critic_pb2_grpc.CriticServiceStub,
    "reference": reference_pb2_grpc.ReferenceServiceStub,
    "reward": reward_pb2_grpc.RewardServiceStub,
}
# rlserve's deployments are <Role>Deployment (e.g. RolloutDeployment in the rollout app)
ROLE_OF_DEPLOYMENT = {f"{role.capitalize()}Deployment": role for role in STUBS}
_MIB = 1 << 20


@dataclass
class AppReport:
    name: str
    serve_status: str
    role: str | None
    """rlserve role of the app's deployment; None for an app that is not an rlserve service."""
    info: object | None = None
    """The service's rlserve.v1.ServiceInfo, when GetInfo answered."""
    problem: str = ""
    """Why GetInfo failed; empty when it answered."""
    processes: list[ProcessMemory] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.serve_status == "RUNNING" and not self.problem


@dataclass
class ClusterReport:
    proxy_address: str
    apps: list[AppReport]
    object_store: ObjectStoreUse

    @property
    def healthy(self) -> bool:
        return all(app.healthy for app in self.apps)


def serve_details() -> dict:
    """Serve's own account of its apps; raises RuntimeError when Serve is not running."""
    from ray.serve.exceptions import RayServeException

    try:
        return placement.serve_details()
    except RayServeException:
        raise RuntimeError("Serve is not running on this cluster: no services to check") from None


def _status(app: dict) -> str:
    """ "RUNNING", "DEPLOYING", ...: Serve hands ApplicationStatus members, not strings."""
    status = app["status"]
    return str(getattr(status, "value", status))


def _role(app: dict) -> str | None:
    for deployment in app.get("deployments") or {}:
        if deployment in ROLE_OF_DEPLOYMENT:
            return ROLE_OF_DEPLOYMENT[deployment]
    return None


async def _service_infos(
    proxy_address: str, apps: list[AppReport], timeout_s: float
) -> list[tuple[object | None, str]]:
    """(info, problem) of each app's GetInfo, all asked at once."""
    channel = open_channel(proxy_address)  # created in the loop it is used from

    async def ask(app: AppReport) -> tuple[object | None, str]:
        if app.role is None:
            return None, ""
        client = ServiceClient(channel, STUBS[app.role], app.name, timeout_s)
        try:
            return await service_info(app.role, client, timeout_s), ""
        except (grpc.aio.AioRpcError, TimeoutError) as error:
            return None, f"GetInfo: {failure_detail(error, timeout_s)}"

    try:
        return await asyncio.gather(*(ask(app) for app in apps))
    finally:
        await channel.close()


def collect(proxy_address: str | None = None, timeout_s: float = 5.0) -> ClusterReport:
    """The report of the cluster this process is connected to (a Ray driver). The proxy
    defaults to Serve's gRPC port on this machine."""
    details = serve_details()
    if proxy_address is None:
        proxy_address = f"127.0.0.1:{details['grpc_options']['port']}"
    apps = [
        AppReport(name=name, serve_status=_status(app), role=_role(app))
        for name, app in sorted((details.get("applications") or {}).items())
    ]
    answers = asyncio.run(_service_infos(proxy_address, apps, timeout_s))
    processes = service_memory()
    for app, (info, problem) in zip(apps, answers, strict=True):
        app.info, app.problem = info, problem
        app.processes = [process for process in processes if process.app == app.name]
    return ClusterReport(proxy_address, apps, object_store_use())


def format_report(report: ClusterReport) -> str:
    store = report.object_store
    lines = [
        f"proxy {report.proxy_address}; object store {store.used_bytes / _MIB:.1f} MiB used "
        f"of {store.capacity_bytes / _MIB:.0f} MiB ({store.objects} objects)",
        "",
        f"{'APP':<12} {'SERVE':<10} {'HEALTH':<9} {'AUTH':<6} {'WEIGHTS':>7} {'STEP':>5}  "
        f"{'PROCESS':<16} {'NODE':<8} {'PID':>7} {'RESIDENT':>12}",
    ]
    for app in report.apps:
        health = "-" if app.role is None else ("ok" if not app.problem else "FAILING")
        weights = step = auth_mode = "-"
        if app.info is not None:
            weights, step = str(app.info.weights_version), str(app.info.last_applied_step)
            auth_mode = app.info.auth_mode or "?"  # "?": a service older than the field
        head = (
            f"{app.name:<12} {app.serve_status:<10} {health:<9} {auth_mode:<6} {weights:>7} "
            f"{step:>5}  "
        )
        if not app.processes:
            lines.append(head + "(no live process)")
        for index, process in enumerate(app.processes):
            resident = (
                "unreadable"
                if process.resident_bytes < 0
                else f"{process.resident_bytes / _MIB:.0f} MiB"
            )
            lines.append(
                (head if index == 0 else " " * len(head))
                + f"{process.kind:<16} {process.node_id[:8]:<8} {process.pid:>7} {resident:>12}"
            )
        if app.info is not None and app.info.lease.holder:
            lease = app.info.lease
            lines.append(
                f"  leased by run {lease.holder!r} (lapses in {lease.expires_in_s:.0f} s "
                "unless renewed)"
            )
        if app.problem:
            lines.append(f"  ! {app.problem}")
    if not report.apps:
        lines.append("(no Serve applications)")
    return "\n".join(lines)


def add_parser(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser(
        "doctor", help="health, weights, memory and object store of a running cluster's services"
    )
    doctor.add_argument("--address", default="auto", help="Ray cluster (default: auto)")
    doctor.add_argument(
        "--target", help="Serve gRPC proxy host:port (default: 127.0.0.1 and Serve's port)"
    )
    doctor.add_argument(
        "--timeout-s", type=float, default=5.0, help="how long each GetInfo may take"
    )


def run(args: argparse.Namespace) -> int:
    from rlserve.core.cluster import connect_ray

    connect_ray(args.address, log_to_driver=False)  # only the report on stdout
    report = collect(args.target, args.timeout_s)
    print(format_report(report))
    return 0 if report.healthy else 1
