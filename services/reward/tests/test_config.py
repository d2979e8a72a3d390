"""RewardServiceConfig validation (errors name the field) and Serve deployment options."""

import pytest

from rlserve.core.config import ConfigError, validate_config
from rlserve.core.message_limits import REWARD_LIMIT_BYTES
from rlserve.reward.app import build_app, deployment_options
from rlserve.reward.config import RewardServiceConfig

RULE = {"rule": {"rule_name": "gsm8k"}}


def _config(**overrides) -> RewardServiceConfig:
    return validate_config(RewardServiceConfig, {"kinds": RULE, **overrides})


def _error(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        validate_config(RewardServiceConfig, data)
    return error.value


def test_all_three_kinds_with_weights():
    config = validate_config(
        RewardServiceConfig,
        {
            "kinds": {
                "rule": {"rule_name": "arithmetic_exact_match", "weight": 1.0},
                "model": {"model_path": "/models/rm", "weight": 0.5},
                "http": {"url": "http://127.0.0.1:1/score", "weight": -0.25},
            }
        },
    )
    assert config.kinds.weights() == {"rule": 1.0, "model": 0.5, "http": -0.25}
    assert config.kinds.http.timeout_s == 3.0  # the default
    assert config.kinds.http.on_failure == "raise"


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        ({"kinds": {}}, "kinds", "set at least one of rule, model, http"),
        ({}, "kinds", "Field required"),
        ({"kinds": {"rule": {}}}, "kinds.rule.rule_name", "Field required"),
        ({"kinds": {"rule": {"rule_name": "gsm9k"}}}, "kinds.rule.rule_name", "registered rules"),
        (
            {"kinds": {"rule": {"rule_name": "nope_module_q:f"}}},
            "kinds.rule.rule_name",
            "cannot import module",
        ),
        (
            {"kinds": {"rule": {"rule_name": "gsm8k", "weight": float("inf")}}},
            "kinds.rule.weight",
            "finite",
        ),
        (
            {"kinds": {"rule": {"rule_name": "gsm8k", "weight": float("nan")}}},
            "kinds.rule.weight",
            "finite",
        ),
        ({"kinds": {"model": {}}}, "kinds.model.model_path", "Field required"),
        ({"kinds": {"model": {"model_path": ""}}}, "kinds.model.model_path", "at least 1"),
        ({"kinds": {"http": {}}}, "kinds.http.url", "Field required"),
        ({"kinds": {"http": {"url": "ftp://x"}}}, "kinds.http.url", "http:// or https://"),
        (
            {"kinds": {"http": {"url": "http://x", "timeout_s": 0}}},
            "kinds.http.timeout_s",
            "greater than 0",
        ),
        (
            {"kinds": {"http": {"url": "http://x", "on_failure": "ignore"}}},
            "kinds.http.on_failure",
            "'raise' or 'fallback'",
        ),
        (
            {"kinds": {"http": {"url": "http://x", "fallback_score": float("nan")}}},
            "kinds.http.fallback_score",
            "finite",
        ),
        (
            {"kinds": {"http": {"url": "http://x", "backoff_initial_s": 3, "backoff_max_s": 1}}},
            "kinds.http.backoff_max_s",
            "must be >= backoff_initial_s",
        ),
        (
            {"kinds": RULE, "num_replicas": 2, "autoscaling_config": {"max_replicas": 3}},
            "num_replicas",
            "not both",
        ),
        (
            {"kinds": RULE, "autoscaling_config": {"min_replicas": 4, "max_replicas": 2}},
            "autoscaling_config.max_replicas",
            "must be >= min_replicas",
        ),
        (
            {"kinds": RULE, "placement": {"resources": {"CPU": 1}}},
            "placement.resources.CPU",
            "built-in",
        ),
        (
            {"kinds": RULE, "placement": {"resources": {"cpu_pool": 0}}},
            "placement.resources.cpu_pool",
            "must be > 0",
        ),
        (
            {"kinds": RULE, "placement": {"label_selector": {"pool": "bad value!"}}},
            "placement.label_selector",
            "Invalid label selector value",
        ),
        ({"kinds": RULE, "max_batch_samples": 0}, "max_batch_samples", "greater than or equal"),
        ({"kinds": {"rules": RULE["rule"]}}, "kinds.rules", "did you mean 'kinds.rule'"),
    ],
)
def test_errors_name_the_field(data, path, message):
    error = _error(data)
    assert path in error.paths, error
    assert message in str(error), error


def test_deployment_options_fixed_replicas_no_gpu_and_placement():
    options = deployment_options(
        _config(
            num_replicas=3,
            num_cpus_per_replica=0.5,
            placement={"resources": {"cpu_pool": 0.001}, "label_selector": {"pool": "cpu"}},
        )
    )
    assert options["num_replicas"] == 3
    assert "autoscaling_config" not in options
    assert options["ray_actor_options"] == {
        "num_cpus": 0.5,
        "num_gpus": 0,
        "resources": {"cpu_pool": 0.001},
        "label_selector": {"pool": "cpu"},
        "runtime_env": {"env_vars": {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(REWARD_LIMIT_BYTES)}},
    }


def test_deployment_options_autoscaling():
    options = deployment_options(
        _config(
            autoscaling_config={"min_replicas": 0, "max_replicas": 8, "target_ongoing_requests": 3}
        )
    )
    assert "num_replicas" not in options
    assert options["autoscaling_config"]["min_replicas"] == 0
    assert options["autoscaling_config"]["max_replicas"] == 8
    assert options["autoscaling_config"]["target_ongoing_requests"] == 3
    assert "initial_replicas" not in options["autoscaling_config"]
    assert options["ray_actor_options"] == {
        "num_cpus": 1.0,
        "num_gpus": 0,
        "runtime_env": {"env_vars": {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(REWARD_LIMIT_BYTES)}},
    }
    assert deployment_options(_config())["num_replicas"] == 1


def test_build_app_validates_before_deploying():
    with pytest.raises(ConfigError, match=r"kinds\.http\.url"):
        build_app({"kinds": {"http": {"url": "localhost:80"}}})
    # Serve checks ray_actor_options in .options() (it rejects unknown keys), so this
    # also shows Serve accepts what deployment_options builds.
    app = build_app(
        {
            "kinds": RULE,
            "num_replicas": 2,
            "placement": {"resources": {"cpu_pool": 0.01}, "label_selector": {"pool": "cpu"}},
        }
    )
    deployment = app._bound_deployment  # no public accessor in Serve 2.60
    assert deployment.num_replicas == 2
    assert deployment.ray_actor_options["num_gpus"] == 0
    assert deployment.ray_actor_options["resources"] == {"cpu_pool": 0.01}
    assert deployment.ray_actor_options["label_selector"] == {"pool": "cpu"}
