"""The deployment files under deploy/ parse, and agree with each other and with the code.

No Ray cluster is started. What is checked:
- every Serve config validates as Ray's ServeDeploySchema; each app's args validate with
  its service's own config model and build its Serve application offline;
- the per-service Serve files together are exactly all.yaml's applications, and the
  RayService's serveConfigV2 is all.yaml, its rayClusterConfig raycluster.yaml's spec;
- the apps' args are exactly what the trainer deploys for deploy/run_config.yaml
  (rlserve.trainer.deploy.service_args), number types included: Serve hashes the JSON of
  an app's args to decide whether it changed, so 8 and 8.0 would restart the app;
- the GPU services share one placement group; every node label an app selects is carried
  by a KubeRay worker group whose pods can hold the bundles (rlserve.core.placement's own
  feasibility check), and the reward's group has no GPU;
- grpc_options register every servicer of rlserve.core.cluster.SERVICER_FUNCTIONS;
- the services deployed alone (STANDALONE: no run deploys them yet) validate, build
  offline without a GPU, and land on a pool a KubeRay worker group carries;
- the ray start scripts pass `bash -n`, and their DRY_RUN commands parse as `ray start`
  arguments of the installed Ray, with the pool labels the Serve files select; they turn
  Ray's token auth on, the head writes the token files it lacks (this user's only), a
  worker refuses to start without them, and no token ever appears in their output.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray import serve
from ray._private.label_utils import parse_node_labels_string, validate_node_labels
from ray.scripts.scripts import start as ray_start_command
from ray.serve.schema import ServeDeploySchema

from rlserve.core import cluster
from rlserve.core.config import load_config, validate_config
from rlserve.core.placement import PlacementError, check_feasible
from rlserve.core.run_config import RunConfig
from rlserve.critic.config import CriticServiceConfig
from rlserve.environment.config import EnvironmentServiceConfig
from rlserve.reference.config import ReferenceServiceConfig
from rlserve.reward.config import RewardServiceConfig
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.trainer.deploy import IMPORT_PATHS, service_args

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SERVE_DIR = DEPLOY / "serve"
RAY_DIR = DEPLOY / "ray"
KUBERAY_DIR = DEPLOY / "kuberay"
RUN_CONFIG = DEPLOY / "run_config.yaml"

ROLES = ("rollout", "critic", "reference", "reward")
STANDALONE = {"environment": EnvironmentServiceConfig}
"""Services with a Serve file of their own that runs do not deploy (yet)."""
WORKER_ROLES = ("rollout", "critic", "reference")
CONFIG_MODELS = {
    "rollout": RolloutServiceConfig,
    "critic": CriticServiceConfig,
    "reference": ReferenceServiceConfig,
    "reward": RewardServiceConfig,
}
POOL_LABEL = "rlserve.io/pool"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def apps_by_name(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {app["name"]: app for app in document["applications"]}


def canonical(value: Any) -> str:
    """JSON as Serve hashes an app's args (sorted keys; 8 and 8.0 differ)."""
    return json.dumps(value, sort_keys=True)


def differing_keys(got: dict[str, Any], want: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {
        key: (got.get(key, "<missing>"), want.get(key, "<missing>"))
        for key in sorted(set(got) | set(want))
        if canonical(got.get(key)) != canonical(want.get(key))
    }


@pytest.fixture(scope="module")
def all_yaml() -> dict[str, Any]:
    return load_yaml(SERVE_DIR / "all.yaml")


@pytest.fixture(scope="module")
def apps(all_yaml: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return apps_by_name(all_yaml)


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return load_yaml(KUBERAY_DIR / "rayservice.yaml")


@pytest.fixture(scope="module")
def raycluster() -> dict[str, Any]:
    return load_yaml(KUBERAY_DIR / "raycluster.yaml")


@pytest.fixture(scope="module")
def trainer_args() -> dict[str, dict[str, Any]]:
    """What `rlserve train --config deploy/run_config.yaml` deploys."""
    config = load_config(RunConfig, RUN_CONFIG)
    return service_args(config, config.model.path)


# --- Serve configs ----------------------------------------------------------------------


def test_serve_directory_holds_all_yaml_and_one_file_per_service():
    assert sorted(path.stem for path in SERVE_DIR.glob("*.yaml")) == sorted(
        ["all", *ROLES, *STANDALONE]
    )


@pytest.mark.parametrize("name", ["all", *ROLES, *STANDALONE])
def test_serve_file_validates_as_serve_config(name: str):
    document = load_yaml(SERVE_DIR / f"{name}.yaml")
    ServeDeploySchema.model_validate(document)
    names = [app["name"] for app in document["applications"]]
    assert names == (sorted(ROLES, key=ROLES.index) if name == "all" else [name])


def test_apps_are_named_routed_and_imported_by_role(apps: dict[str, dict[str, Any]]):
    assert sorted(apps) == sorted(ROLES)
    for role, app in apps.items():
        assert app["route_prefix"] == f"/{role}", role  # without one, calls get NOT_FOUND
        assert app["import_path"] == IMPORT_PATHS[role] == f"rlserve.{role}.app:build_app"


def test_per_service_files_together_equal_all_yaml(apps: dict[str, dict[str, Any]]):
    for role in ROLES:
        (single,) = load_yaml(SERVE_DIR / f"{role}.yaml")["applications"]
        assert canonical(single) == canonical(apps[role]), (
            f"{role}.yaml differs from its entry in all.yaml: "
            f"{differing_keys(single.get('args', {}), apps[role].get('args', {}))}"
        )


@pytest.mark.parametrize("role", ROLES)
def test_args_validate_with_the_service_config(apps: dict[str, dict[str, Any]], role: str):
    config = validate_config(CONFIG_MODELS[role], apps[role]["args"])
    if role in WORKER_ROLES:
        assert config.placement is not None
        config.placement.require_room_for(config.workers)


@pytest.mark.parametrize("role", ROLES)
def test_app_builds_without_a_cluster(apps: dict[str, dict[str, Any]], role: str):
    module_name, function_name = apps[role]["import_path"].split(":")
    build_app = getattr(importlib.import_module(module_name), function_name)
    ray_was_running = ray.is_initialized()
    application = build_app(apps[role]["args"])
    assert isinstance(application, serve.Application)
    assert ray.is_initialized() == ray_was_running, "building the app started Ray"
    if role == "reward":
        deployment = application._bound_deployment
        options = deployment.ray_actor_options
        assert options["num_gpus"] == 0
        assert options["label_selector"] == {POOL_LABEL: "cheap"}
        autoscaling = deployment._deployment_config.autoscaling_config
        assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 8)
        assert autoscaling.target_ongoing_requests == 2


def test_proxy_options_register_every_servicer(all_yaml: dict[str, Any]):
    assert all_yaml["proxy_location"] == "HeadOnly"
    assert all_yaml["http_options"]["host"] == "127.0.0.1"
    grpc = all_yaml["grpc_options"]
    assert grpc["port"] == 9000
    functions = grpc["grpc_servicer_functions"]
    assert len(functions) == len(set(functions))
    assert set(functions) == set(cluster.SERVICER_FUNCTIONS)
    for path in functions:
        module_name, _, function_name = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module_name), function_name)), path


def test_run_config_grpc_port_is_the_serve_port(all_yaml: dict[str, Any]):
    config = load_config(RunConfig, RUN_CONFIG)
    assert config.trainer.serve_grpc_port == all_yaml["grpc_options"]["port"]


# --- the files against the trainer's deploy ---------------------------------------------


def test_run_config_deploys_all_four_services(trainer_args: dict[str, dict[str, Any]]):
    assert sorted(trainer_args) == sorted(ROLES)


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_worker_placement_is_what_the_trainer_deploys(
    apps: dict[str, dict[str, Any]], trainer_args: dict[str, dict[str, Any]], role: str
):
    got, want = apps[role]["args"]["placement"], trainer_args[role]["placement"]
    assert got == want, differing_keys(got, want)


@pytest.mark.parametrize("role", ROLES)
def test_args_are_exactly_what_the_trainer_deploys(
    apps: dict[str, dict[str, Any]], trainer_args: dict[str, dict[str, Any]], role: str
):
    got, want = apps[role]["args"], trainer_args[role]
    assert canonical(got) == canonical(want), (
        f"{role}: args differ from service_args(deploy/run_config.yaml) as (file, trainer): "
        f"{differing_keys(got, want)}"
    )


def test_gpu_services_share_one_placement_group(apps: dict[str, dict[str, Any]]):
    placements = {role: apps[role]["args"]["placement"] for role in WORKER_ROLES}
    first = placements["rollout"]
    assert first["group_name"] == "rlserve-global_pool"
    assert first["label_selector"] == {POOL_LABEL: "gpu"}
    for role, placement in placements.items():
        for key in ("group_name", "pool", "bundles", "strategy", "label_selector"):
            assert placement[key] == first[key], f"{role}: placement.{key}"
    # Bundles in the order rollout, critic, reference; each role's slice right after the last.
    offset = 0
    for role in WORKER_ROLES:
        workers = apps[role]["args"].get("workers", 1)
        assert placements[role]["bundle_offset"] == offset, role
        offset += workers
    assert offset == len(first["bundles"]), "bundles nobody uses, or too few"
    assert all(bundle.get("GPU", 0) >= 1 for bundle in first["bundles"])


@pytest.mark.parametrize("name", STANDALONE)
def test_a_standalone_service_file_is_its_configs_defaults_and_builds_offline(name: str):
    (app,) = load_yaml(SERVE_DIR / f"{name}.yaml")["applications"]
    assert app["route_prefix"] == f"/{name}"
    assert app["import_path"] == f"rlserve.{name}.app:build_app"
    config = validate_config(STANDALONE[name], app["args"])
    # written out whole, as Serve hashes it: a default changed in code shows here
    assert canonical(app["args"]) == canonical(config.model_dump(mode="json"))
    module_name, function_name = app["import_path"].split(":")
    application = getattr(importlib.import_module(module_name), function_name)(app["args"])
    options = application._bound_deployment.ray_actor_options
    assert options["num_gpus"] == 0
    assert options["label_selector"] == {POOL_LABEL: "cheap"}


# --- KubeRay ----------------------------------------------------------------------------


def worker_groups(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {group["groupName"]: group for group in spec["workerGroupSpecs"]}


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for group in groups for c in group["template"]["spec"]["containers"]]


def group_labels(group: dict[str, Any]) -> dict[str, str]:
    """Ray node labels of a group's pods: the `labels` field or rayStartParams.labels."""
    labels = dict(group.get("labels") or {})
    labels.update(parse_node_labels_string(group.get("rayStartParams", {}).get("labels", "")))
    return labels


def cpu_quantity(value: str | int | float) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def pod_resources(group: dict[str, Any]) -> dict[str, float]:
    """Ray resources of one pod of the group: rayStartParams, else the container limits."""
    params = group.get("rayStartParams", {})
    (container,) = group["template"]["spec"]["containers"]
    limits = container.get("resources", {}).get("limits", {})
    resources = {
        "CPU": cpu_quantity(params.get("num-cpus", limits.get("cpu", 0))),
        "GPU": float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))),
    }
    resources.update(json.loads(params.get("resources", "{}")))
    return resources


def simulated_nodes(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every worker pod the cluster can reach (maxReplicas per group), as the nodes
    rlserve.core.placement.check_feasible reads."""
    return [
        {
            "node_id": f"{name}-{index}",
            "labels": group_labels(group),
            "resources": pod_resources(group),
        }
        for name, group in worker_groups(spec).items()
        for index in range(group["maxReplicas"])
    ]


def label_selectors(apps: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {role: apps[role]["args"]["placement"]["label_selector"] for role in ROLES}


def groups_matching(spec: dict[str, Any], selector: dict[str, str]) -> list[dict[str, Any]]:
    for value in selector.values():
        # Ray's selector operators (!x, in(...)) are not used in these files; extend here.
        assert not value.startswith(("!", "in(", "!in(")), value
    return [
        group
        for group in worker_groups(spec).values()
        if all(group_labels(group).get(key) == value for key, value in selector.items())
    ]


def test_rayservice_serve_config_is_all_yaml(rayservice: dict[str, Any], all_yaml: dict):
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["kind"] == "RayService"
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert canonical(serve_config) == canonical(all_yaml)


def test_rayservice_cluster_is_raycluster(rayservice: dict[str, Any], raycluster: dict):
    assert raycluster["apiVersion"] == "ray.io/v1"
    assert raycluster["kind"] == "RayCluster"
    assert rayservice["spec"]["rayClusterConfig"] == raycluster["spec"]


def test_cluster_runs_this_ray_and_one_image(raycluster: dict[str, Any]):
    spec = raycluster["spec"]
    assert spec["rayVersion"] == ray.__version__
    assert len({c["image"] for c in containers(spec)}) == 1


def test_every_ray_container_has_both_tokens_and_no_usage_stats(raycluster: dict[str, Any]):
    # Ray's token auth through the operator (it sets RAY_AUTH_MODE / RAY_AUTH_TOKEN), so no
    # container may set RAY_AUTH_MODE itself; the services' token from the user's Secret.
    assert raycluster["spec"]["authOptions"] == {"mode": "token"}
    for container in containers(raycluster["spec"]):
        env = {item["name"]: item for item in container.get("env", [])}
        assert "RAY_AUTH_MODE" not in env and "RAY_AUTH_TOKEN" not in env, container["name"]
        assert env["RAY_USAGE_STATS_ENABLED"]["value"] == "0", container["name"]
        secret = env["RLSERVE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert secret == {"name": "rlserve-auth", "key": "token"}, container["name"]


def test_pods_run_unprivileged_and_only_the_head_mounts_a_service_account_token(
    raycluster: dict[str, Any],
):
    spec = raycluster["spec"]
    head = spec["headGroupSpec"]["template"]["spec"]
    # the in-tree autoscaler runs as a sidecar of the head pod and calls the Kubernetes API
    assert spec["enableInTreeAutoscaling"] and head["automountServiceAccountToken"] is True
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, group["groupName"]
    for pod in [head, *(g["template"]["spec"] for g in spec["workerGroupSpecs"])]:
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in containers(spec):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]


def test_network_policy_admits_only_the_clusters_pods_and_the_operator(
    raycluster: dict[str, Any],
):
    policy = load_yaml(KUBERAY_DIR / "networkpolicy.yaml")
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    pod_labels = raycluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    groups = [raycluster["spec"]["headGroupSpec"], *raycluster["spec"]["workerGroupSpecs"]]
    assert all(g["template"]["metadata"]["labels"] == pod_labels for g in groups)
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": pod_labels}  # every rlserve pod
    assert "Ingress" in spec["policyTypes"]
    own_pods, operator = spec["ingress"]
    # the pods reach each other on every port (Ray, Serve gRPC, direct ingress, gloo) ...
    assert own_pods == {"from": [{"podSelector": {"matchLabels": pod_labels}}]}
    # ... and the operator only the dashboard; nobody else is admitted
    (source,) = operator["from"]
    assert set(source) == {"namespaceSelector"}
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]


def test_head_group_has_no_gpu_no_pool_and_serves_grpc(raycluster: dict, all_yaml: dict):
    head = raycluster["spec"]["headGroupSpec"]
    params = head["rayStartParams"]
    assert params.get("num-cpus") == "0"
    assert params.get("num-gpus", "0") == "0"
    assert POOL_LABEL not in group_labels(head)
    (container,) = head["template"]["spec"]["containers"]
    for kind in ("limits", "requests"):
        assert "nvidia.com/gpu" not in container["resources"].get(kind, {})
    ports = {port["containerPort"] for port in container["ports"]}
    assert {6379, 8265, 10001, all_yaml["grpc_options"]["port"]} <= ports


def test_groups_label_nodes_as_kuberay_accepts(raycluster: dict[str, Any]):
    spec = raycluster["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        # KubeRay v1.5+ rejects rayStartParams.labels next to the `labels` field.
        assert "labels" not in group.get("rayStartParams", {})
        assert validate_node_labels(group_labels(group)) is None
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


@pytest.mark.parametrize("role", ROLES)
def test_label_selector_is_carried_by_a_worker_group(
    apps: dict[str, dict[str, Any]], raycluster: dict[str, Any], role: str
):
    selector = label_selectors(apps)[role]
    assert selector, f"{role} selects no pool"
    assert groups_matching(raycluster["spec"], selector), f"{role}: no group has {selector}"


def test_reward_pool_group_has_no_gpu_and_room_for_max_replicas(
    apps: dict[str, dict[str, Any]], raycluster: dict[str, Any]
):
    reward = apps["reward"]["args"]
    groups = groups_matching(raycluster["spec"], reward["placement"]["label_selector"])
    assert groups
    for group in groups:
        assert group["rayStartParams"].get("num-gpus", "0") == "0"
        (container,) = group["template"]["spec"]["containers"]
        for kind in ("limits", "requests"):
            assert "nvidia.com/gpu" not in container.get("resources", {}).get(kind, {})
        assert pod_resources(group)["GPU"] == 0
    per_replica = reward["num_cpus_per_replica"]
    assert all(pod_resources(group)["CPU"] >= per_replica for group in groups)
    most = reward["autoscaling_config"]["max_replicas"] * per_replica
    assert sum(pod_resources(g)["CPU"] * g["maxReplicas"] for g in groups) >= most


def test_gpu_pods_declare_the_gpus_ray_offers(raycluster: dict[str, Any]):
    for group in worker_groups(raycluster["spec"]).values():
        (container,) = group["template"]["spec"]["containers"]
        limits = container.get("resources", {}).get("limits", {})
        assert float(limits.get("nvidia.com/gpu", 0)) == pod_resources(group)["GPU"]
        assert cpu_quantity(limits["cpu"]) >= pod_resources(group)["CPU"]


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_gpu_bundles_fit_the_pool_pods(
    apps: dict[str, dict[str, Any]], raycluster: dict[str, Any], role: str
):
    placement = apps[role]["args"]["placement"]
    groups = groups_matching(raycluster["spec"], placement["label_selector"])
    for index, bundle in enumerate(placement["bundles"]):
        assert any(
            all(pod_resources(group).get(name, 0) >= amount for name, amount in bundle.items())
            for group in groups
        ), f"{role}: bundle {index} {bundle} is larger than any pod of its pool"
    # The whole group, as rlserve checks it before creating it on a live cluster.
    check_feasible(
        placement["pool"],
        placement["bundles"],
        placement["strategy"],
        placement["label_selector"],
        simulated_nodes(raycluster["spec"]),
    )


def test_simulated_nodes_reject_a_bundle_no_pod_can_hold(raycluster: dict[str, Any]):
    """The feasibility check above can fail: one GPU more than a pod has does not fit."""
    nodes = simulated_nodes(raycluster["spec"])
    most_gpus = max(node["resources"]["GPU"] for node in nodes)
    with pytest.raises(PlacementError, match="fits on none"):
        check_feasible("global_pool", [{"GPU": most_gpus + 1}], "PACK", {POOL_LABEL: "gpu"}, nodes)
    with pytest.raises(PlacementError, match="no alive node carries"):
        check_feasible("global_pool", [{"CPU": 1}], "PACK", {POOL_LABEL: "gpus"}, nodes)


# --- ray start scripts ------------------------------------------------------------------


SCRIPTS = sorted(RAY_DIR.glob("*.sh"))


def test_start_scripts_exist_and_are_executable():
    names = {path.name for path in SCRIPTS}
    assert {"start-head.sh", "start-worker.sh"} <= names
    for name in ("start-head.sh", "start-worker.sh"):
        assert os.access(RAY_DIR / name, os.X_OK), name


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_script_passes_bash_n(script: Path):
    subprocess.run(["bash", "-n", str(script)], check=True, capture_output=True)


# A home without token files (a dry run writes nothing), and tokens a worker is given.
NO_TOKENS_HOME = "/nonexistent/rlserve-test-home"
WORKER_TOKENS = {"RAY_AUTH_TOKEN": "ray-secret-4f2a", "RLSERVE_AUTH_TOKEN": "rlserve-secret-9c1e"}
# What both scripts run `ray start` with: rlserve's Ray environment, with Ray's token auth on.
SCRIPT_ENV = {**cluster._RAY_ENV_DEFAULTS, "RAY_AUTH_MODE": "token"}


def run_script(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(RAY_DIR / script), *args],
        env={"PATH": os.environ["PATH"], "HOME": NO_TOKENS_HOME, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def dry_run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_script(script, *args, DRY_RUN="1", **env)


def parsed_ray_start(script: str, *args: str, **env: str) -> tuple[dict[str, str], dict]:
    """(environment, `ray start` parameters) of the command a script would run."""
    result = dry_run(script, *args, **env)
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assert words[0] == "env"
    assignments = [word for word in words[1:] if "=" in word and not word.startswith("-")]
    command = words[1 + len(assignments) :]
    assert command[:2] == ["ray", "start"], command
    # The installed Ray's own option parser: an unknown flag raises NoSuchOption.
    context = ray_start_command.make_context("start", command[2:])
    environment = dict(word.split("=", 1) for word in assignments)
    return environment, context.params


def test_head_script_defaults(all_yaml: dict[str, Any]):
    environment, params = parsed_ray_start("start-head.sh")
    token_file = f"{NO_TOKENS_HOME}/.rlserve/auth_token"
    assert environment == {**SCRIPT_ENV, "RLSERVE_AUTH_TOKEN_FILE": token_file}
    assert params["head"] is True
    assert params["port"] == 6379
    assert params["dashboard_host"] == "127.0.0.1"
    assert params["disable_usage_stats"] is True
    assert parse_node_labels_string(params["labels"]) == {}  # the head is in no pool


def test_head_script_takes_dashboard_host_and_resources():
    _, params = parsed_ray_start(
        "start-head.sh",
        DASHBOARD_HOST="0.0.0.0",
        NUM_CPUS="0",
        OBJECT_STORE_BYTES="2000000000",
        RESOURCES='{"cpu_pool": 1000}',
    )
    assert params["dashboard_host"] == "0.0.0.0"
    assert params["num_cpus"] == 0
    assert params["object_store_memory"] == 2_000_000_000
    assert json.loads(params["resources"]) == {"cpu_pool": 1000}


def test_gpu_worker_carries_the_label_the_gpu_services_select(apps: dict[str, dict[str, Any]]):
    environment, params = parsed_ray_start(
        "start-worker.sh",
        "10.0.0.1:6379",
        "--block",
        POOL="gpu",
        NUM_GPUS="8",
        NUM_CPUS="64",
        LABELS="zone=a",
        **WORKER_TOKENS,
    )
    assert environment == SCRIPT_ENV  # the tokens are inherited, never shown
    assert params["address"] == "10.0.0.1:6379"
    assert params["block"] is True
    assert (params["num_gpus"], params["num_cpus"]) == (8, 64)
    labels = parse_node_labels_string(params["labels"])
    assert validate_node_labels(labels) is None
    assert labels == {POOL_LABEL: "gpu", "zone": "a"}
    for role in WORKER_ROLES:
        selector = apps[role]["args"]["placement"]["label_selector"]
        assert all(labels.get(key) == value for key, value in selector.items()), role


def test_cheap_worker_carries_the_reward_label_and_no_gpu(apps: dict[str, dict[str, Any]]):
    _, params = parsed_ray_start(
        "start-worker.sh", POOL="cheap", RAY_HEAD_ADDRESS="head:6379", **WORKER_TOKENS
    )
    assert params["address"] == "head:6379"
    assert params["num_gpus"] == 0
    labels = parse_node_labels_string(params["labels"])
    assert labels == apps["reward"]["args"]["placement"]["label_selector"]


@pytest.mark.parametrize(
    "args, env",
    [
        (["10.0.0.1:6379"], {}),  # no POOL
        (["10.0.0.1:6379"], {"POOL": "gpus"}),
        (["10.0.0.1:6379"], {"POOL": "cheap", "NUM_GPUS": "1"}),
        (["10.0.0.1:6379"], {"POOL": "gpu", "NUM_GPUS": "0"}),
        (["10.0.0.1:6379"], {"POOL": "gpu", "NUM_CPUS": "2.5"}),
        (["10.0.0.1:6379"], {"POOL": "gpu", "LABELS": f"{POOL_LABEL}=cheap"}),
        (["10.0.0.1:6379"], {"POOL": "gpu", "RAY_AUTH_MODE": "off"}),
        ([], {"POOL": "gpu"}),  # no head address
        (["10.0.0.1:6379"], {"POOL": "gpu", "RAY_AUTH_TOKEN": ""}),  # no Ray token
        (["10.0.0.1:6379"], {"POOL": "gpu", "RLSERVE_AUTH_TOKEN": ""}),  # no rlserve token
    ],
)
def test_worker_script_refuses_bad_settings(args: list[str], env: dict[str, str]):
    result = dry_run("start-worker.sh", *args, **{**WORKER_TOKENS, **env})
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.strip()


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_head_script_writes_missing_token_files_for_this_user_only(tmp_path: Path):
    # RAY=true: the script runs `true start --head ...` in place of Ray.
    first = run_script("start-head.sh", HOME=str(tmp_path), RAY="true")
    assert first.returncode == 0, first.stderr
    ray_file, rlserve_file = tmp_path / ".ray/auth_token", tmp_path / ".rlserve/auth_token"
    ray_token, rlserve_token = ray_file.read_text(), rlserve_file.read_text().strip()
    assert len(ray_token) == 64 and set(ray_token) <= set("0123456789abcdef")
    assert len(rlserve_token) == 43 and rlserve_token.replace("-", "").replace("_", "").isalnum()
    for path in (ray_file, rlserve_file):
        assert _mode(path) == 0o600 and _mode(path.parent) == 0o700, path
        assert str(path) in first.stderr
    assert f"RLSERVE_AUTH_TOKEN_FILE={rlserve_file} true start --head" in first.stderr
    again = run_script("start-head.sh", HOME=str(tmp_path), RAY="true")
    assert again.returncode == 0, again.stderr
    assert ray_file.read_text() == ray_token  # an existing token is kept
    assert rlserve_file.read_text().strip() == rlserve_token
    for result in (first, again):
        assert ray_token not in result.stdout + result.stderr
        assert rlserve_token not in result.stdout + result.stderr


def test_worker_script_uses_copies_of_the_heads_token_files(tmp_path: Path):
    for name in (".ray", ".rlserve"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "auth_token").write_text("copied-token\n")
    environment, _ = parsed_ray_start(
        "start-worker.sh", "10.0.0.1:6379", POOL="gpu", HOME=str(tmp_path)
    )
    assert environment == {
        **SCRIPT_ENV,
        "RLSERVE_AUTH_TOKEN_FILE": str(tmp_path / ".rlserve/auth_token"),
    }
    (tmp_path / ".rlserve/auth_token").write_text("")
    empty = dry_run("start-worker.sh", "10.0.0.1:6379", POOL="gpu", HOME=str(tmp_path))
    assert empty.returncode != 0 and "RLSERVE_AUTH_TOKEN_FILE" in empty.stderr


def test_scripts_never_print_a_token_given_by_value():
    for script, args in (("start-head.sh", ()), ("start-worker.sh", ("10.0.0.1:6379",))):
        result = dry_run(script, *args, POOL="gpu", **WORKER_TOKENS)
        assert result.returncode == 0, result.stderr
        for token in WORKER_TOKENS.values():
            assert token not in result.stdout + result.stderr, script


def test_disabled_ray_auth_needs_no_ray_token():
    environment, _ = parsed_ray_start(
        "start-worker.sh",
        "10.0.0.1:6379",
        POOL="gpu",
        RAY_AUTH_MODE="disabled",
        RLSERVE_AUTH_TOKEN="x",
    )
    assert environment == cluster._RAY_ENV_DEFAULTS


# --- README -----------------------------------------------------------------------------


def test_readme_names_every_deploy_file():
    readme = (DEPLOY / "README.md").read_text()
    files = [RUN_CONFIG, *SERVE_DIR.glob("*.yaml"), *KUBERAY_DIR.glob("*.yaml"), *SCRIPTS]
    named = [path.relative_to(DEPLOY).as_posix() for path in files]
    missing = [name for name in named if name not in readme]
    assert not missing, f"deploy/README.md does not mention {missing}"
