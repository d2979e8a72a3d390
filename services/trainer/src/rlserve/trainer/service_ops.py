"""`rlserve service ...`: deploy, update, scale or remove one service on a running cluster.

A plain `serve deploy` of one service's file replaces Serve's whole declared config and
so deletes every other app. These commands read the apps already declared, change only
the named one and apply the merged config, so Serve leaves the others running untouched
(it compares each app's config and redeploys only what changed).

  rlserve service deploy FILE [--app NAME ...]     add or update apps from a Serve config
  rlserve service scale reward --replicas N        fixed replica count
  rlserve service scale reward --min N --max M [--target-ongoing-requests R]   autoscaling
  rlserve service remove NAME
  rlserve service status                           apps, replicas and the nodes they run on
  rlserve service release-placement GROUP          remove a pool's placement group

Each takes --address (Ray cluster, default 'auto'), --grpc-port (Serve's gRPC proxy
port, used only when Serve is not running yet; default 9000) and --timeout-s, before or
after the action.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import yaml
from ray.serve.schema import ServeDeploySchema

from rlserve.core.config import ConfigError
from rlserve.core.placement import serve_details
from rlserve.trainer.deploy import declared_applications, deploy_applications, remove_application

# Services whose one replica owns training state (DeepSpeed engines, optimizer): more
# replicas would be independent policies. They scale by `workers` instead.
STATEFUL_APPS = ("rollout", "critic")


def read_serve_config(path: Path) -> list[dict[str, Any]]:
    """The applications of a Serve config file, validated by Serve's own schema."""
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: cannot read it as YAML: {error}") from None
    if not isinstance(document, dict) or "applications" not in document:
        raise ConfigError(f"{path}: not a Serve config (needs a top-level 'applications' list)")
    try:
        ServeDeploySchema(**document)
    except ValueError as error:
        raise ConfigError(f"{path}: invalid Serve config: {error}") from None
    return document["applications"]


def deploy_from_file(path: Path, only: list[str] | None, timeout_s: float) -> list[str]:
    """Deploys (or updates) the file's apps, or only those named; returns their names."""
    applications = read_serve_config(path)
    names = [app["name"] for app in applications]
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ConfigError(f"--app {unknown}: not in {path} (it has {names})")
        applications = [app for app in applications if app["name"] in only]
    deploy_applications(applications, timeout_s)
    return [app["name"] for app in applications]


def scaled_app(
    app: dict[str, Any],
    replicas: int | None,
    min_replicas: int | None,
    max_replicas: int | None,
    target_ongoing_requests: float | None,
) -> dict[str, Any]:
    """`app` with its replica count or autoscaling changed (args of the service's config)."""
    if app["name"] in STATEFUL_APPS:
        raise ConfigError(
            f"{app['name']}: its one replica owns the training state; scale its data-parallel "
            "workers instead (args.workers) with `rlserve service deploy`"
        )
    scaled = copy.deepcopy(app)
    args = scaled.setdefault("args", {})
    if replicas is not None:
        if min_replicas is not None or max_replicas is not None:
            raise ConfigError("--replicas excludes --min/--max (fixed count vs autoscaling)")
        args.pop("autoscaling_config", None)
        args["num_replicas"] = replicas
        return scaled
    if min_replicas is None or max_replicas is None:
        raise ConfigError("give --replicas N, or --min and --max for autoscaling")
    autoscaling = dict(args.get("autoscaling_config") or {})
    autoscaling.update(min_replicas=min_replicas, max_replicas=max_replicas)
    if target_ongoing_requests is not None:
        autoscaling["target_ongoing_requests"] = target_ongoing_requests
    args.pop("num_replicas", None)
    args["autoscaling_config"] = autoscaling
    return scaled


def scale(name: str, timeout_s: float, **counts: Any) -> dict[str, Any]:
    declared = declared_applications()
    if name not in declared:
        raise ConfigError(f"no app {name!r} deployed by config; deployed: {sorted(declared)}")
    app = scaled_app(declared[name], **counts)
    deploy_applications([app], timeout_s)
    return app


def status_rows() -> list[tuple[str, str, str, str]]:
    """(app, status, deployment, replicas with their nodes) for every Serve app."""
    details = serve_details()
    rows = []
    for name, app in sorted((details.get("applications") or {}).items()):
        for deployment_name, deployment in (app.get("deployments") or {}).items():
            replicas = [
                f"{replica['state']}@{replica['node_id'][:8]}"
                for replica in deployment.get("replicas") or []
            ]
            rows.append((name, app["status"], deployment_name, " ".join(replicas) or "-"))
    return rows


def _cluster_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """--address, --grpc-port, --timeout-s. Each action takes them too, without defaults
    of its own, so they may stand before or after the action: `service --address X
    deploy F` and `service deploy F --address X` mean the same."""

    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--address", default=default("auto"), help="Ray cluster (default: auto)")
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=default(9000),
        help="Serve gRPC port if Serve must be started (default: 9000)",
    )
    parser.add_argument("--timeout-s", type=float, default=default(600.0))


def add_parser(commands: argparse._SubParsersAction) -> None:
    service = commands.add_parser("service", help="manage one service on a running cluster")
    _cluster_options(service, defaults=True)
    actions = service.add_subparsers(dest="action", required=True)
    deploy = actions.add_parser("deploy", help="add or update apps from a Serve config file")
    deploy.add_argument("file", type=Path)
    deploy.add_argument("--app", action="append", help="only this app (repeatable)")
    scale_parser = actions.add_parser("scale", help="replicas or autoscaling of one app")
    scale_parser.add_argument("name")
    scale_parser.add_argument("--replicas", type=int)
    scale_parser.add_argument("--min", dest="min_replicas", type=int)
    scale_parser.add_argument("--max", dest="max_replicas", type=int)
    scale_parser.add_argument("--target-ongoing-requests", type=float)
    remove = actions.add_parser("remove", help="delete one app")
    remove.add_argument("name")
    actions.add_parser("status", help="apps, replicas and their nodes")
    release = actions.add_parser("release-placement", help="remove a named placement group")
    release.add_argument("group")
    for action in actions.choices.values():
        _cluster_options(action, defaults=False)


def run(args: argparse.Namespace) -> int:
    """Connects to the cluster (starting Serve if needed) and performs one action."""
    from rlserve.core.cluster import connect_ray, start_serve
    from rlserve.core.placement import release_placement_group

    connect_ray(args.address)
    start_serve(args.grpc_port)  # attaches when Serve already runs
    if args.action == "deploy":
        names = deploy_from_file(args.file, args.app, args.timeout_s)
        print(f"running: {', '.join(names)}")
    elif args.action == "scale":
        app = scale(
            args.name,
            args.timeout_s,
            replicas=args.replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
        )
        scaling = app["args"].get("autoscaling_config") or app["args"]["num_replicas"]
        print(f"{args.name}: {scaling}")
    elif args.action == "remove":
        remove_application(args.name, args.timeout_s)
        print(f"removed {args.name}")
    elif args.action == "release-placement":
        found = release_placement_group(args.group)
        print(f"released {args.group}" if found else f"no placement group {args.group!r}")
        return 0 if found else 1
    else:
        for row in status_rows():
            print("  ".join(row))
    return 0
