"""Deploying the services a run needs onto Serve, from the run config.

The trainer never imports a service: it hands Serve each service's app builder by
import path with plain args (the same form as a Serve config file), so a service can
equally be deployed by `serve deploy`, by KubeRay, or by this code. Every service gets
the run's `trainer.tracing` as its `tracing` arg, so one setting traces the whole stack.
"""

import os
import sys
import time
from typing import Any

from ray.serve.schema import ServeDeploySchema

from rlserve.core.config import ConfigError, ConfigModel, redacted_values, secret_field_names
from rlserve.core.devices import worker_gpus
from rlserve.core.inputs_config import LARGE_MODEL_WEIGHT_BYTES, model_weight_bytes
from rlserve.core.placement import (
    PlacementError,
    alive_nodes,
    ensure_placement_group,
    group_bundle_nodes,
    nodes_matching,
    serve_details,
    serve_replicas,
)
from rlserve.core.placement_config import WorkerPlacementConfig
from rlserve.core.reward_settings import RewardSettings
from rlserve.core.run_config import RunConfig
from rlserve.core.shortfall import Shortfall, resource_shortfall
from rlserve.core.worker_settings import ActorSettings, CriticSettings, ReferenceConfig
from rlserve.trainer.checkpoint import services_checkpoint_root


class ServiceSettingsConflict(RuntimeError):
    """A service is deployed with other settings than the run would deploy."""


IMPORT_PATHS = {
    "rollout": "rlserve.rollout.app:build_app",
    "critic": "rlserve.critic.app:build_app",
    "reference": "rlserve.reference.app:build_app",
    "reward": "rlserve.reward.app:build_app",
    "environment": "rlserve.environment.app:build_app",
}
# The services that run worker groups (the reward runs in its replicas).
WORKER_ROLES = frozenset({"rollout", "critic", "reference"})
# The services scaled out by replicas, placed by a node selector, not a placement group.
REPLICA_ROLES = frozenset({"reward", "environment"})
# Fields a run sets that must not be printed (the run's args carry them in plain data).
SECRET_FIELDS = secret_field_names(RunConfig)


def settings_of(section: ConfigModel, settings: type[ConfigModel]) -> dict[str, Any]:
    """The fields of a run-config section that are the service's settings (the section
    subclasses `settings`; the service's config does too), by name and unchanged."""
    return section.model_dump(include=set(settings.model_fields))


def service_args(config: RunConfig, model_dir: str) -> dict[str, dict[str, Any]]:
    """Args of each service's build_app for this run; only the services it uses.

    Each worker service gets its run section's settings whole (settings_of), plus what
    the run decides elsewhere: the model, dtype, mini-batch in samples, checkpoint root,
    placement and tracing; the rollout also its generation limits from `rollout`."""
    n = config.rollout.responses_per_prompt
    deployed = {"model_path": model_dir, "dtype": config.model.dtype}
    checkpoint_root = services_checkpoint_root(config.trainer.run_dir)
    # Batches from GenerateSequences carry their temperature; this is the fallback.
    temperature = config.rollout.temperature or 1.0
    apps: dict[str, dict[str, Any]] = {
        "rollout": {
            **settings_of(config.actor, ActorSettings),
            **deployed,
            "engine": config.generation_engine,
            "seed": config.trainer.seed,
            "ppo_mini_batch_samples": config.actor.ppo_mini_batch_prompts * n,
            # The service's own cap must admit the run's responses.
            "max_new_tokens_limit": max(1024, config.rollout.max_new_tokens),
            "max_batch_samples": config.rollout.max_batch_samples,
            "max_request_tokens": config.rollout.max_request_tokens,
            "checkpoint_root": checkpoint_root,
            "temperature": temperature,
            # The same model on both sides: every field reaches the service as it is.
            "vllm": config.rollout.vllm.model_dump(),
        },
        "reward": reward_args(config),
    }
    if config.rollout.agent is not None:
        # the tools multi-turn responses call, on the reward's nodes and replica size
        apps["environment"] = {
            **config.rollout.agent.environment.model_dump(),
            "num_cpus_per_replica": apps["reward"].get("num_cpus_per_replica", 1.0),
        }
        if "placement" in apps["reward"]:
            apps["environment"]["placement"] = apps["reward"]["placement"]
    if config.needs_reference and config.reference_merged:
        apps["rollout"]["serve_reference"] = True
    elif config.needs_reference:
        apps["reference"] = {
            **settings_of(config.reference, ReferenceConfig),
            **deployed,
            "temperature": temperature,
        }
    if config.needs_critic:
        apps["critic"] = {
            **settings_of(config.critic, CriticSettings),
            **deployed,
            "model_path": critic_model_path(config, model_dir),
            "ppo_mini_batch_samples": config.critic.ppo_mini_batch_prompts * n,
            "checkpoint_root": checkpoint_root,
        }
    for role, placement in worker_placements(config, apps).items():
        apps[role]["placement"] = placement
        # A worker's torch threads follow its bundle's CPUs (critic and reference derive
        # them from num_cpus_per_worker, the rollout has its own field).
        cpus = placement["bundles"][placement["bundle_offset"]].get("CPU", 1.0)
        apps[role]["num_cpus_per_worker"] = max(1.0, cpus)
        if role == "rollout":
            apps[role]["torch_threads_per_worker"] = max(1, int(cpus))
    node_cpus = config.placement.node_cpus
    if node_cpus is None and config.trainer.ray_address is None and not config.placement.roles:
        node_cpus = len(os.sched_getaffinity(0))  # the local cluster's node is this machine
    large = model_weight_bytes(model_dir) >= LARGE_MODEL_WEIGHT_BYTES
    for role in WORKER_ROLES.intersection(apps):
        apps[role]["keep_freed_pages"] = large
    if config.placement.stage_threads and node_cpus is not None and large:
        for role, threads in stage_thread_plan(config, apps, node_cpus).items():
            apps[role]["stage_threads"] = threads
    tracing = config.trainer.tracing.model_dump()
    auth_mode = config.trainer.service_auth
    return {role: {**args, "tracing": tracing, "auth": auth_mode} for role, args in apps.items()}


def stage_thread_plan(
    config: RunConfig, apps: dict[str, dict[str, Any]], node_cpus: int
) -> dict[str, dict[str, int]]:
    """torch threads per stage of each worker role (StageThreads' fields), when its
    workers share one node of `node_cpus` cores: in each stage, the cores split evenly
    among the worker processes busy in it at once.

    Generation keeps the rollout workers busy (with rollout.mode one_step_off, the
    reference and critic forwards and the critic update overlap it); the forwards are
    the rollout's log-prob pass (none with a single-pass update), the reference's (in
    the rollout's processes, one after the other, when merged) and the critic's values;
    the updates are the actor's and the critic's, concurrently.
    """
    workers = {
        role: int(apps[role].get("workers", 1))
        for role in ("rollout", "critic", "reference")
        if role in apps
    }
    rollout, critic = workers["rollout"], workers.get("critic", 0)
    reference = workers.get("reference", 0)
    merged_reference = config.needs_reference and config.reference_merged
    rollout_forwards = not config.single_pass_update or merged_reference
    overlapping = reference + critic if config.rollout.mode == "one_step_off" else 0
    busy = {
        "generate": rollout + overlapping,
        "forward": rollout * rollout_forwards + reference + critic,
        "update": rollout + critic,
    }
    threads = {stage: max(1, node_cpus // max(1, count)) for stage, count in busy.items()}
    return dict.fromkeys(workers, threads)


def worker_placements(
    config: RunConfig, apps: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Each placed worker role's `placement` arg: the pool's one group, holding the
    bundles of every deployed role in that pool (rollout, critic, reference order)."""
    placement = config.placement
    placements: dict[str, dict[str, Any]] = {}
    for pool_name, pool in placement.pools.items():
        roles = [role for role in placement.roles_in_pool(pool_name) if role in apps]
        bundles: list[dict[str, float]] = []
        offsets = {}
        for role in roles:
            offsets[role] = len(bundles)
            resources = dict(placement.roles[role].worker_resources)
            bundles += [dict(resources) for _ in range(apps[role].get("workers", 1))]
        for role in roles:
            placements[role] = {
                "group_name": f"{placement.group_prefix}-{pool_name}",
                "pool": pool_name,
                "bundles": bundles,
                "bundle_offset": offsets[role],
                "strategy": pool.strategy,
                "label_selector": dict(pool.label_selector),
                "timeout_s": placement.timeout_s,
            }
    return placements


# The run config's section of each worker role (its fields name the fix).
RUN_SECTIONS = {"rollout": "actor", "critic": "critic", "reference": "reference"}
# The roles whose ranks form an NCCL group when on GPUs (the reference joins none).
TRAINING_ROLES = ("rollout", "critic")


def share_gpus(apps: dict[str, dict[str, Any]], cluster_gpus: float) -> None:
    """Sets `gpus_per_worker` of each worker role that has no placement bundle and may
    use a GPU (device cuda or auto), from all of them together: a whole GPU each where
    the cluster has enough, else an equal share of one (rlserve.core.devices
    .worker_gpus), so that on one GPU the rollout, critic and reference all start
    instead of the first taking it and the others waiting for one.

    Raises ConfigError, before any service starts, for a training role of several
    workers that would share GPUs (its ranks' NCCL group refuses two on one GPU), and
    for device cuda on a cluster without a GPU.
    """
    unplaced = [
        role
        for role in RUN_SECTIONS
        if role in apps and "placement" not in apps[role] and apps[role]["device"] != "cpu"
    ]
    gpu_workers = sum(apps[role]["workers"] for role in unplaced)
    for role in unplaced:
        section = RUN_SECTIONS[role]
        try:
            gpus = worker_gpus(apps[role]["device"], cluster_gpus, gpu_workers)
        except ValueError as error:
            raise ConfigError(f"{section}.device", str(error)) from None
        if 0 < gpus < 1 and role in TRAINING_ROLES and apps[role]["workers"] > 1:
            raise ConfigError(
                f"{section}.workers",
                f"the run's {gpu_workers} GPU workers share the cluster's {cluster_gpus:g} "
                f"GPUs ({gpus:g} of one each), and {apps[role]['workers']} ranks of one NCCL "
                f"group may then land on one GPU, which NCCL refuses; set {section}.workers: "
                "1, give other roles device: cpu, or add GPUs",
            )
        if role == "rollout" and apps[role]["engine"] == "vllm" and 0 < gpus < 1:
            utilization = apps[role]["vllm"]["gpu_memory_utilization"]
            if utilization >= gpus:
                # The run config's own check (RunConfig._vllm_memory_issues) cannot know
                # this share: it depends on the cluster's GPUs.
                raise ConfigError(
                    "rollout.vllm.gpu_memory_utilization",
                    f"{utilization:g} of the GPU, but each rollout worker gets {gpus:g} of "
                    f"one: the run's {gpu_workers} GPU workers share the cluster's "
                    f"{cluster_gpus:g} GPUs, and vLLM refuses to start unless its fraction "
                    f"is free; set it below {gpus:g} with room for the actor's training "
                    f"copy (e.g. {gpus / 2:.2f}), give critic/reference device: cpu, or add "
                    "GPUs",
                )
        if gpus > 0:
            # Only then: a CPU run's args stay those of services deployed one by one
            # (service_args alone), so a run joins them instead of finding them changed.
            apps[role]["gpus_per_worker"] = gpus


def share_cluster_gpus(apps: dict[str, dict[str, Any]]) -> None:
    """share_gpus with the GPUs of the cluster's alive nodes."""
    share_gpus(apps, sum(node["resources"].get("GPU", 0) for node in alive_nodes()))


def reserve_placement_groups(apps: dict[str, dict[str, Any]]) -> None:
    """Creates every pool's placement group before the services start, so an impossible
    placement fails here, at once, naming the pool and the missing resources."""
    seen = set()
    for role, args in apps.items():
        placement = args.get("placement")
        # a replica role's placement is a node selector for its replicas, not a group
        if role not in REPLICA_ROLES and placement and placement["group_name"] not in seen:
            seen.add(placement["group_name"])
            ensure_placement_group(WorkerPlacementConfig(**placement))


def reference_application(config: RunConfig) -> str | None:
    """The Serve app that answers ReferenceService calls in this run, if any."""
    if not config.needs_reference:
        return None
    return "rollout" if config.reference_merged else "reference"


def critic_model_path(config: RunConfig, model_dir: str) -> str:
    return config.critic.model_path or model_dir


def reward_args(config: RunConfig) -> dict[str, Any]:
    """The run's reward section whole (its kinds, limits and scaling), plus the
    replicas' place from the run's placement."""
    args = settings_of(config.reward, RewardSettings)
    placed = config.placement.roles.get("reward")
    if placed is not None:
        pool = config.placement.pools[placed.pool]
        resources = dict(placed.worker_resources)
        args["num_cpus_per_replica"] = resources.pop("CPU", 1.0)
        resources.pop("GPU", None)  # config validation already refused a GPU
        args["placement"] = {
            "label_selector": dict(pool.label_selector),
            "resources": {name: amount for name, amount in resources.items() if amount > 0},
        }
    return args


def verify_placement(config: RunConfig, apps: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Reads where every placed worker bundle and reward replica actually runs and checks
    the pool rules; returns node ids by role, or raises PlacementError naming each breach."""
    nodes = alive_nodes()
    breaches: list[str] = []
    where: dict[str, list[str]] = {}
    for role, args in apps.items():
        placement = args.get("placement")
        if role in REPLICA_ROLES or not placement:
            continue
        bundle_nodes = group_bundle_nodes(placement["group_name"])
        offset, workers = placement["bundle_offset"], args.get("workers", 1)
        where[role] = bundle_nodes[offset : offset + workers]
        pool_nodes = {n["node_id"] for n in nodes_matching(nodes, placement["label_selector"])}
        outside = [node for node in where[role] if node not in pool_nodes]
        if outside:
            breaches.append(f"{role}: workers on {outside}, outside pool {placement['pool']!r}")
        if placement["strategy"] == "STRICT_PACK" and len(set(bundle_nodes)) != 1:
            breaches.append(f"pool {placement['pool']!r}: STRICT_PACK group on {bundle_nodes}")
    reward_pool = config.placement.roles.get("reward")
    if "reward" in apps and reward_pool is not None:
        selector = config.placement.pools[reward_pool.pool].label_selector
        pool_nodes = {n["node_id"] for n in nodes_matching(nodes, selector)}
        replicas = serve_replicas("reward")
        where["reward"] = [replica["node_id"] for replica in replicas]
        for replica in replicas:
            if replica["node_id"] not in pool_nodes:
                breaches.append(
                    f"reward: replica {replica['replica_id']} on node "
                    f"{replica['node_id'][:12]}, outside pool {reward_pool.pool!r}"
                )
            if replica["required_resources"].get("GPU", 0) > 0:
                breaches.append(f"reward: replica {replica['replica_id']} holds a GPU")
    if breaches:
        raise PlacementError("placement rules broken after deployment: " + "; ".join(breaches))
    return where


def settings_differences(
    wanted: dict[str, dict[str, Any]], deployed: dict[str, dict[str, Any]]
) -> list[str]:
    """One line per setting where an app already deployed (a Serve config entry) differs
    from what this run would deploy; apps not deployed yet differ in nothing."""
    lines = []
    for role, args in wanted.items():
        entry = deployed.get(role)
        if entry is None:
            continue
        deployed_path = entry.get("import_path")
        if deployed_path != IMPORT_PATHS[role]:
            lines.append(f"{role}: import_path {deployed_path!r}, run wants {IMPORT_PATHS[role]!r}")
            continue
        current = entry.get("args") or {}
        for key in sorted(set(args) | set(current)):
            if current.get(key, "<unset>") != args.get(key, "<unset>"):
                # printed and raised: a secret (an HTTP kind's headers) shows as redacted
                was, wants = (
                    redacted_values(side.get(key, "<unset>"), SECRET_FIELDS)
                    for side in (current, args)
                )
                lines.append(f"{role}.{key}: deployed {was!r}, run wants {wants!r}")
    return lines


SHORTFALL_TIMEOUT_S = 15.0
"""How long deploy waits on replicas or workers that no node has the free resources
for before it fails naming them (trainer.resource_shortfall_timeout_s)."""
SHORTFALL_NOTICE_S = 3.0
"""A shortfall seen this long is printed at once; shorter ones are placements under way."""


class ResourceShortfallError(RuntimeError):
    """Deploy gave up on services whose actors the cluster has no free resources for."""


def deploy_services(
    apps: dict[str, dict[str, Any]],
    timeout_s: float,
    replace_different: bool = False,
    shortfall_timeout_s: float | None = SHORTFALL_TIMEOUT_S,
) -> dict[str, float]:
    """Deploys (or updates) one app per role, named and routed by the role.

    A role already deployed with other settings is replaced only with
    `replace_different`; otherwise nothing is deployed and the error lists every
    difference, so a run never silently overwrites a service someone configured by hand.
    Returns each role's seconds until it was running (deploy_applications).
    """
    differences = settings_differences(apps, declared_applications())
    if differences and not replace_different:
        raise ServiceSettingsConflict(
            "services already deployed with other settings than this run's:\n  "
            + "\n  ".join(differences)
            + "\nset trainer.replace_deployed_services=true to replace them, change the run "
            "config to match, or remove them first (rlserve service remove <role>)"
        )
    return deploy_applications(
        [
            {
                "name": role,
                "route_prefix": f"/{role}",
                "import_path": IMPORT_PATHS[role],
                "args": args,
            }
            for role, args in apps.items()
        ],
        timeout_s,
        shortfall_timeout_s,
    )


def declared_applications() -> dict[str, dict[str, Any]]:
    """The Serve config entries of the apps deployed declaratively, by name."""
    details = serve_details()
    return {
        name: app["deployed_app_config"]
        for name, app in (details.get("applications") or {}).items()
        if app.get("deployed_app_config")
    }


def _apply(applications: dict[str, dict[str, Any]]) -> None:
    from ray.serve.context import _get_global_client

    # The declarative path (what `serve deploy` uses): Serve imports each builder itself,
    # deletes declared apps missing from the list and leaves unchanged ones running.
    _get_global_client().deploy_apps(ServeDeploySchema(applications=list(applications.values())))


UNHEALTHY_GRACE_S = 120.0
"""How long an app may stay UNHEALTHY while deploying: Serve replaces a replica that
fails its health check within seconds, and a new one loads its weights and builds its
engines (a minute on a small CPU node)."""


def deploy_applications(
    applications: list[dict[str, Any]],
    timeout_s: float,
    shortfall_timeout_s: float | None = SHORTFALL_TIMEOUT_S,
) -> dict[str, float]:
    """Deploys or updates Serve config entries (name, route_prefix, import_path, args) next
    to the apps already declared, which keep running untouched, and waits until every
    one given is RUNNING; a failed deployment raises with Serve's message. An UNHEALTHY
    app is one whose replica failed its health check and is being replaced by Serve
    (e.g. a worker died while no trainer was watching): it raises only if it stays
    unhealthy for UNHEALTHY_GRACE_S.

    While an app is not running, a replica or worker of it that no node has the free
    resources for is printed after SHORTFALL_NOTICE_S, with what every node offers, and
    raises ResourceShortfallError once it has waited `shortfall_timeout_s` (None: only
    print, for a cluster whose autoscaler adds nodes).

    Returns the seconds from the request until each app was seen RUNNING (polled every
    0.5 s; the apps deploy concurrently, so the largest is the deployment's wall time).
    """
    from ray import serve

    started = time.monotonic()
    merged = declared_applications()
    merged.update((app["name"], app) for app in applications)
    _apply(merged)
    names = [app["name"] for app in applications]
    ready_s: dict[str, float] = {}
    unhealthy_since: dict[str, float] = {}
    watch = _ShortfallWatch(names, shortfall_timeout_s)
    deadline = started + timeout_s
    while True:
        statuses = serve.status().applications
        pending = {}
        for name in names:
            status = statuses.get(name)
            state = status.status if status else "NOT_STARTED"
            if state == "UNHEALTHY":
                since = unhealthy_since.setdefault(name, time.monotonic())
                if time.monotonic() - since > UNHEALTHY_GRACE_S:
                    raise RuntimeError(
                        f"service {name!r} stayed unhealthy for {UNHEALTHY_GRACE_S:.0f} s: "
                        f"{_failure(status)}"
                    )
            else:
                unhealthy_since.pop(name, None)
            if state == "DEPLOY_FAILED":
                raise RuntimeError(f"service {name!r} failed to deploy: {_failure(status)}")
            if state != "RUNNING":
                pending[name] = getattr(state, "value", state)
            else:
                ready_s.setdefault(name, time.monotonic() - started)
        if not pending:
            return ready_s
        watch.check(pending)
        if time.monotonic() > deadline:
            reasons = {name: _failure(statuses[name]) for name in pending if name in statuses}
            raise TimeoutError(
                f"services not running after {timeout_s:.0f} s (trainer.deploy_timeout_s): "
                f"{pending}"
                + "".join(f"\n{name}: {reason}" for name, reason in reasons.items() if reason)
                + (f"\n{watch.last.describe()}" if watch.last else "")
            )
        time.sleep(0.5)


class _ShortfallWatch:
    """Asks the cluster every CHECK_EVERY_S what it cannot place for these apps, and
    acts on a shortfall that lasts: a print at SHORTFALL_NOTICE_S, an error at the
    timeout. A shortfall that clears (a placement under way) starts the clock again."""

    CHECK_EVERY_S = 1.0

    def __init__(self, apps: list[str], timeout_s: float | None):
        self.apps = apps
        self.timeout_s = timeout_s
        self.since: float | None = None
        self.last: Shortfall | None = None
        self.printed = False
        self.checked_at = time.monotonic()

    def check(self, pending: dict[str, str]) -> None:
        now = time.monotonic()
        if now - self.checked_at < self.CHECK_EVERY_S:
            return
        self.checked_at = now
        self.last = resource_shortfall(self.apps)
        if self.last is None:
            self.since = None
            return
        self.since = self.since or now
        waited_s = now - self.since
        if waited_s >= SHORTFALL_NOTICE_S and not self.printed:
            self.printed = True
            print(f"services {pending} are {self.last.describe()}", file=sys.stderr)
        if self.timeout_s is not None and waited_s >= self.timeout_s:
            raise ResourceShortfallError(
                f"services not running after {waited_s:.0f} s of waiting on resources "
                f"(trainer.resource_shortfall_timeout_s={self.timeout_s:g}; null waits for "
                f"an autoscaler up to trainer.deploy_timeout_s): {pending}\n" + self.last.describe()
            )


def _failure(status: Any) -> str:
    """The app's message plus its deployments' (where a replica's exception is)."""
    reasons = [status.message] + [
        deployment.message for deployment in status.deployments.values() if deployment.message
    ]
    # A replica's message ends with its exception line; the traceback above it is noise.
    return " | ".join(reason.strip().splitlines()[-1] for reason in reasons if reason.strip())


def remove_application(name: str, timeout_s: float) -> None:
    """Deletes one declared app and waits until it is gone; the others keep running."""
    from ray import serve

    declared = declared_applications()
    if name not in declared:
        raise KeyError(f"no application {name!r} deployed by config; deployed: {sorted(declared)}")
    del declared[name]
    _apply(declared)
    deadline = time.monotonic() + timeout_s
    while name in serve.status().applications:
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {name!r} still present after {timeout_s:.0f} s")
        time.sleep(0.5)
