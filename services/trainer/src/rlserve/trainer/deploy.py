"""Deploying the services a run needs onto Serve, from the run config.

The trainer never imports a service: it hands Serve each service's app builder by
import path with plain args (the same form as a Serve config file), so a service can
equally be deployed by `serve deploy`, by KubeRay, or by this code. Every service gets
the run's `trainer.tracing` as its `tracing` arg, so one setting traces the whole stack.
"""

import time
from typing import Any

from ray.serve.schema import ServeDeploySchema

from rlserve.core.run_config import RunConfig

IMPORT_PATHS = {
    "rollout": "rlserve.rollout.app:build_app",
    "critic": "rlserve.critic.app:build_app",
    "reference": "rlserve.reference.app:build_app",
    "reward": "rlserve.reward.app:build_app",
}


def service_args(config: RunConfig, model_dir: str) -> dict[str, dict[str, Any]]:
    """Args of each service's build_app for this run; only the services it uses."""
    n = config.rollout.responses_per_prompt
    actor, critic = config.actor, config.critic
    seed = config.trainer.seed
    apps: dict[str, dict[str, Any]] = {
        "rollout": {
            "model_path": model_dir,
            "dtype": config.model.dtype,
            "engine": config.rollout.engine,
            "workers": actor.workers,
            "seed": seed,
            "zero_stage": actor.zero_stage,
            "lr": actor.lr,
            "grad_clip": actor.grad_clip,
            "ppo_epochs": actor.ppo_epochs,
            "ppo_mini_batch_samples": actor.ppo_mini_batch_prompts * n,
            "micro_batch_samples": actor.micro_batch_samples,
            "clip_ratio_low": actor.clip_ratio_low,
            "clip_ratio_high": actor.clip_ratio_high,
            "clip_ratio_dual": actor.clip_ratio_dual,
            "loss_agg_mode": actor.loss_agg_mode,
            "entropy_coef": actor.entropy_coef,
            "use_kl_loss": actor.use_kl_loss,
            "kl_loss_coef": actor.kl_loss_coef,
            "kl_loss_kind": actor.kl_loss_kind,
        },
        "reward": reward_args(config),
    }
    if config.needs_reference:
        apps["reference"] = {
            "model_path": model_dir,
            "dtype": config.model.dtype,
            "temperature": config.rollout.temperature or 1.0,
        }
    if config.needs_critic:
        apps["critic"] = {
            "model_path": critic_model_path(config, model_dir),
            "dtype": config.model.dtype,
            "workers": critic.workers,
            "zero_stage": critic.zero_stage,
            "lr": critic.lr,
            "grad_clip": critic.grad_clip,
            "ppo_epochs": critic.ppo_epochs,
            "ppo_mini_batch_samples": critic.ppo_mini_batch_prompts * n,
            "micro_batch_samples": critic.micro_batch_samples,
            "cliprange_value": critic.cliprange_value,
        }
    # Needs the services' `tracing` config field (rlserve.core.run_config.TracingConfig).
    tracing = config.trainer.tracing.model_dump()
    return {role: {**args, "tracing": tracing} for role, args in apps.items()}


def critic_model_path(config: RunConfig, model_dir: str) -> str:
    return config.critic.model_path or model_dir


def reward_args(config: RunConfig) -> dict[str, Any]:
    reward = config.reward
    if reward.kind == "rule":
        kinds: dict[str, Any] = {"rule": {"rule_name": reward.rule_name}}
    elif reward.kind == "model":
        kinds = {"model": {"model_path": reward.model_path}}
    else:
        http = reward.http
        kinds = {
            "http": {
                "url": http.url,
                "timeout_s": http.timeout_s,
                "max_concurrency": http.max_concurrency,
                "retries": http.retries,
                "on_failure": http.on_failure,
                "fallback_score": http.fallback_score,
            }
        }
    return {"kinds": kinds}


def deploy_services(apps: dict[str, dict[str, Any]], timeout_s: float) -> None:
    """Deploys (or updates) one app per role, named and routed by the role."""
    deploy_applications(
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
    )


def deploy_applications(applications: list[dict[str, Any]], timeout_s: float) -> None:
    """Deploys Serve config entries (name, route_prefix, import_path, args) and waits
    until every one is RUNNING; a failed deployment raises with Serve's message."""
    from ray import serve
    from ray.serve.context import _get_global_client

    # The declarative path (what `serve deploy` uses): Serve imports each builder itself.
    _get_global_client().deploy_apps(ServeDeploySchema(applications=applications))
    names = [app["name"] for app in applications]
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = serve.status().applications
        pending = {}
        for name in names:
            status = statuses.get(name)
            state = status.status if status else "NOT_STARTED"
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"service {name!r} failed to deploy: {status.message}")
            if state != "RUNNING":
                pending[name] = state
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"services not running after {timeout_s:.0f} s (trainer.deploy_timeout_s): "
                f"{pending}"
            )
        time.sleep(0.5)
