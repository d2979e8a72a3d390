"""Every setting a service accepts is reachable from the run config.

The trainer deploys each service from `service_args(run config)`; a service field that
no run-config field reaches is a knob users cannot turn (as the ComputeLogProb
micro-batch once was). A worker service's config subclasses its run section's settings
(rlserve.core.worker_settings) and its deployment (rlserve.core.service_config), so a
field added to the settings is a run-config field that reaches the service with no other
edit; these tests check that every other field of a service config is one the trainer
derives, list each service config's fields against what the trainer sets, and check the
args validate in the service's own config model, so a renamed or dropped field fails
here.
"""

import pytest

from rlserve.core.algos.policy_loss_registry import POLICY_LOSSES
from rlserve.core.config import validate_config
from rlserve.core.environment_settings import EnvironmentSettings
from rlserve.core.inputs_config import LARGE_MODEL_WEIGHT_BYTES
from rlserve.core.reward_settings import RewardSettings
from rlserve.core.run_config import RunConfig
from rlserve.core.service_config import TrainingDeployment, WorkerDeployment
from rlserve.core.worker_settings import ActorSettings, CriticSettings, ReferenceConfig
from rlserve.critic.config import CriticServiceConfig
from rlserve.critic.controller import worker_kwargs as critic_worker_kwargs
from rlserve.environment.config import EnvironmentServiceConfig
from rlserve.reference.config import ReferenceServiceConfig
from rlserve.reference.controller import worker_kwargs as reference_worker_kwargs
from rlserve.reward.config import RewardServiceConfig
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.rollout.worker import actor_worker_kwargs
from rlserve.trainer.deploy import service_args

SERVICE_CONFIGS = {
    "rollout": RolloutServiceConfig,
    "critic": CriticServiceConfig,
    "reference": ReferenceServiceConfig,
    "reward": RewardServiceConfig,
}
# Set only under a condition; each has its own test (gpus_per_worker: once the cluster's
# GPUs are known, services/trainer/tests/test_deploy_args.py).
CONDITIONAL = {
    "rollout": {"serve_reference", "stage_threads", "gpus_per_worker"},
    "critic": {"stage_threads", "gpus_per_worker"},
    "reference": {"stage_threads", "gpus_per_worker"},
}
# Each worker service's settings: (the class its config subclasses, the run section).
SETTINGS = {
    "rollout": (ActorSettings, "actor"),
    "critic": (CriticSettings, "critic"),
    "reference": (ReferenceConfig, "reference"),
    "reward": (RewardSettings, "reward"),
}
# What the trainer derives from elsewhere in the run (model, placement, other sections).
DERIVED = {
    "rollout": set(TrainingDeployment.model_fields)
    | {"engine", "vllm", "seed", "temperature", "max_new_tokens_limit", "max_batch_samples",
       "max_request_tokens", "torch_threads_per_worker", "serve_reference"},
    "critic": set(TrainingDeployment.model_fields),
    "reference": set(WorkerDeployment.model_fields) | {"temperature"},
    "reward": {"num_cpus_per_replica", "placement", "tracing", "auth"},
}  # fmt: skip
EVERY_ROLE_PLACED = {
    "pools": {"gpu": {}},
    "roles": {role: {"pool": "gpu"} for role in ("rollout", "critic", "reference", "reward")},
}


def _config(**sections) -> RunConfig:
    return validate_config(RunConfig, {"placement": EVERY_ROLE_PLACED, **sections})


@pytest.mark.parametrize("role", SERVICE_CONFIGS)
def test_every_service_field_is_set_from_the_run_config(role):
    args = service_args(_config(), "/models/policy")[role]
    unreached = set(SERVICE_CONFIGS[role].model_fields) - set(args) - CONDITIONAL.get(role, set())
    assert not unreached, f"{role} settings no run-config field reaches: {sorted(unreached)}"


@pytest.mark.parametrize("role", SETTINGS)
def test_a_service_setting_is_a_run_config_field_that_reaches_it_unchanged(role):
    """Adding a field to a service: in its settings class it is settable from the run
    config and passed on; anywhere else in the service's config, this test names it."""
    settings, section_name = SETTINGS[role]
    service = SERVICE_CONFIGS[role]
    assert issubclass(service, settings)
    outside = set(service.model_fields) - set(settings.model_fields) - DERIVED[role]
    assert not outside, (
        f"{role} service fields neither in {settings.__name__} (the run's "
        f"{section_name} section) nor derived by the trainer: {sorted(outside)}"
    )
    config = _config()
    section = getattr(config, section_name)
    assert isinstance(section, settings)
    args = service_args(config, "/models/policy")[role]
    derived_here = DERIVED[role] & set(settings.model_fields)  # e.g. limits from `rollout`
    section_values = section.model_dump()
    for name in set(settings.model_fields) - derived_here:
        assert args[name] == section_values[name], name


@pytest.mark.parametrize("role", SERVICE_CONFIGS)
def test_service_args_validate_in_the_service_config(role):
    args = service_args(_config(), "/models/policy")[role]
    validate_config(SERVICE_CONFIGS[role], args)


def test_forward_and_memory_knobs_reach_the_workers():
    config = _config(
        actor={
            "forward_micro_batch_samples": 7,
            "logits_chunk_tokens": 96,
            "gradient_checkpointing": True,
            "device": "cpu",
            "weight_decay": 0.01,
        },
        critic={
            "forward_micro_batch_samples": 5,
            "device": "cpu",
            "loss_agg_mode": "seq-mean-token-sum",
        },
        reference={"forward_micro_batch_samples": 3, "logits_chunk_tokens": 32, "device": "cpu"},
    )
    apps = service_args(config, "/models/policy")
    actor = actor_worker_kwargs(validate_config(RolloutServiceConfig, apps["rollout"]))
    assert actor["forward_micro_batch_samples"] == 7
    assert actor["logits_chunk_tokens"] == 96
    assert actor["gradient_checkpointing"] is True
    assert actor["setup"].device == "cpu"
    assert actor["optimizer"].weight_decay == 0.01
    critic = critic_worker_kwargs(validate_config(CriticServiceConfig, apps["critic"]))
    assert (critic["forward_micro_batch_samples"], critic["setup"].device) == (5, "cpu")
    assert critic["loss"].loss_agg_mode == "seq-mean-token-sum"
    reference = reference_worker_kwargs(validate_config(ReferenceServiceConfig, apps["reference"]))
    assert (reference["forward_micro_batch_samples"], reference["logits_chunk_tokens"]) == (3, 32)


def test_policy_loss_choice_and_knobs_reach_the_actor_worker():
    """actor.policy_loss and its knobs travel run config -> rollout service -> worker."""
    config = _config(
        actor={
            "policy_loss": "clip_cov",
            "clip_ratio_low": 0.25,
            "clip_ratio_high": 0.28,
            "loss_agg_mode": "seq-mean-token-sum-norm",
            "clip_cov_fraction": 0.01,
            "clip_cov_low": 0.5,
            "clip_cov_high": 4.0,
            "kl_cov_fraction": 0.02,
            "kl_cov_coef": 0.3,
            "kl_loss_kind": "low_var_kl+",
        }
    )
    rollout = validate_config(RolloutServiceConfig, service_args(config, "/m")["rollout"])
    loss = actor_worker_kwargs(rollout)["loss"]
    assert loss.policy_loss == "clip_cov"
    assert loss.loss_agg_mode == "seq-mean-token-sum-norm"
    assert loss.kl_loss_kind == "low_var_kl+"
    knobs = loss.knobs  # the policy loss reads its own from these, by name
    assert (knobs["clip_ratio_low"], knobs["clip_ratio_high"]) == (0.25, 0.28)
    assert knobs["loss_agg_mode"] == "seq-mean-token-sum-norm"
    assert (knobs["clip_cov_fraction"], knobs["clip_cov_low"], knobs["clip_cov_high"]) == (
        0.01,
        0.5,
        4.0,
    )
    assert (knobs["kl_cov_fraction"], knobs["kl_cov_coef"]) == (0.02, 0.3)
    assert set(POLICY_LOSSES.lookup("clip_cov").knob_names) <= set(knobs)


def test_rollout_service_rejects_an_unknown_policy_loss_naming_the_choices():
    args = service_args(_config(), "/m")["rollout"] | {"policy_loss": "ppo"}
    with pytest.raises(Exception, match=r"policy_loss: Input should be 'vanilla', 'gspo'"):
        validate_config(RolloutServiceConfig, args)


def test_long_responses_raise_the_rollout_limit():
    config = _config(
        rollout={"max_new_tokens": 3000, "max_request_tokens": 2_000_000},
        critic={"max_request_tokens": 1_000_000},
        reference={"max_request_tokens": 1_000_000},
        data={"max_prompt_tokens": 64},
    )
    rollout = validate_config(RolloutServiceConfig, service_args(config, "/m")["rollout"])
    assert rollout.max_new_tokens_limit == 3000


def test_serve_reference_is_set_when_the_reference_is_merged():
    config = validate_config(
        RunConfig,
        {"placement": {"reference_in_rollout": True}, "algorithm": {"kl_ctrl": {"kl_coef": 0.1}}},
    )
    apps = service_args(config, "/m")
    assert apps["rollout"]["serve_reference"] is True
    assert "reference" not in apps


def test_reward_replicas_and_autoscaling_reach_the_service():
    fixed = service_args(_config(reward={"num_replicas": 3}), "/m")["reward"]
    assert validate_config(RewardServiceConfig, fixed).num_replicas == 3
    scaled = service_args(
        _config(reward={"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}), "/m"
    )["reward"]
    assert validate_config(RewardServiceConfig, scaled).autoscaling_config.max_replicas == 4


def test_every_reward_kind_setting_reaches_the_service():
    """The run's reward.kinds is the service's kinds model: each kind's every field
    arrives as the run set it (secrets included: the service needs them)."""
    kinds = {
        "rule": {"rule_name": "gsm8k", "weight": 0.5, "max_text_chars": 1000, "time_budget_s": 2.5},
        "model": {
            "model_path": "/models/rm",
            "weight": 2.0,
            "dtype": "bfloat16",
            "micro_batch_samples": 4,
        },
        "http": {
            "url": "https://verifier.example/score",
            "weight": -1.0,
            "headers": {"Authorization": "Bearer t"},
            "timeout_s": 9.0,
            "max_concurrency": 3,
            "retries": 5,
            "backoff_initial_s": 0.5,
            "backoff_max_s": 4.0,
            "on_failure": "fallback",
            "fallback_score": -2.0,
            "deadline_reserve_s": 0.3,
            "redirects": "same_origin",
            "max_response_bytes": 4096,
        },
    }
    config = _config(reward={"kinds": kinds})
    reward = validate_config(RewardServiceConfig, service_args(config, "/m")["reward"])
    assert reward.kinds.model_dump() == kinds
    assert reward.kinds == config.reward.kinds


def test_a_step_larger_than_a_service_request_limit_is_a_config_error():
    with pytest.raises(Exception, match=r"critic\.max_batch_samples: 100 is below the 256"):
        validate_config(RunConfig, {"critic": {"max_batch_samples": 100}})


def test_vllm_settings_reach_the_worker_whole():
    """rollout.vllm is one model end to end: every field arrives at the worker's kwargs."""
    vllm = {
        "kv_cache_gib": None,
        "gpu_memory_utilization": 0.3,
        "max_model_len": 640,
        "enforce_eager": False,
        "sleep_while_training": True,
    }
    config = _config(rollout={"engine": "vllm", "vllm": vllm})
    rollout = validate_config(RolloutServiceConfig, service_args(config, "/m")["rollout"])
    assert actor_worker_kwargs(rollout)["vllm"] == vllm


def test_stage_threads_reach_every_worker_service_where_the_cores_are_known(tmp_path):
    with (tmp_path / "model.safetensors").open("wb") as weights:
        weights.truncate(LARGE_MODEL_WEIGHT_BYTES)  # sparse: a large model's size, no disk
    config = _config(placement={**EVERY_ROLE_PLACED, "node_cpus": 6})
    apps = service_args(config, str(tmp_path))
    for role in ("rollout", "critic", "reference"):
        assert set(apps[role]["stage_threads"]) == {"generate", "forward", "update"}, role


def test_an_agent_run_deploys_the_environment_with_its_settings_and_the_rewards_nodes():
    """rollout.agent.environment reaches the environment service whole (EnvironmentSettings
    is both that section and the base of the service's config); its replicas go where the
    reward's do; a run without rollout.agent deploys none."""
    assert "environment" not in service_args(_config(), "/models/policy")
    environment = {"tools": {"calc": {"tool": "calculator", "timeout_s": 5.0}}, "max_sessions": 9}
    config = _config(rollout={"agent": {"environment": environment}})
    args = service_args(config, "/models/policy")["environment"]
    service = validate_config(EnvironmentServiceConfig, args)
    assert issubclass(EnvironmentServiceConfig, EnvironmentSettings)
    section = config.rollout.agent.environment.model_dump()
    for name in EnvironmentSettings.model_fields:
        assert args[name] == section[name], name
    outside = set(EnvironmentServiceConfig.model_fields) - set(EnvironmentSettings.model_fields)
    assert outside <= DERIVED["reward"] and outside <= set(args), sorted(outside)
    assert service.tools["calc"].timeout_s == 5.0 and service.max_sessions == 9
    assert args["placement"] == service_args(config, "/models/policy")["reward"]["placement"]
