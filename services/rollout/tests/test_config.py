"""RolloutServiceConfig and the app builder reject bad settings, naming the field."""

import pytest

from rlserve.core.config import ConfigError, validate_config
from rlserve.rollout.app import build_app
from rlserve.rollout.config import RolloutServiceConfig


def config(**fields) -> RolloutServiceConfig:
    return validate_config(RolloutServiceConfig, {"model_path": "/models/policy", **fields})


def test_defaults_split_evenly():
    settings = config(workers=2, ppo_mini_batch_samples=16, micro_batch_samples=4)
    assert settings.worker_mini_batch_samples == 8 and settings.grad_accum_steps == 2


@pytest.mark.parametrize(
    ("fields", "path", "hint"),
    [
        ({"workers": 3, "ppo_mini_batch_samples": 16}, "workers", "must divide"),
        (
            {"workers": 2, "ppo_mini_batch_samples": 16, "micro_batch_samples": 3},
            "micro_batch_samples",
            "share of a mini-batch, 8 samples",
        ),
        ({"use_kl_loss": True, "kl_loss_coef": 0.0}, "kl_loss_coef", "is 0"),
        ({"engine": "tgi"}, "engine", ""),
        ({"zero_stage": 4}, "zero_stage", ""),
        ({"clip_ratio_dual": 1.0}, "clip_ratio_dual", ""),
        ({"lr_rate": 1e-3}, "lr_rate", "unknown field"),
    ],
)
def test_bad_settings_name_the_field(fields, path, hint):
    with pytest.raises(ConfigError) as error:
        config(**fields)
    assert path in error.value.paths
    assert hint in str(error.value)


def test_app_builder_validates_before_deploying():
    with pytest.raises(ConfigError) as error:
        build_app({"model_path": "/models/policy", "workers": 3, "ppo_mini_batch_samples": 8})
    assert error.value.paths == ("workers",)
    with pytest.raises(ConfigError) as error:
        build_app({"workers": 1})
    assert error.value.paths == ("model_path",)


def test_ranks_on_shares_of_a_gpu_are_refused_naming_workers():
    with pytest.raises(ConfigError, match=r"workers.*NCCL refuses.*workers: 1"):
        validate_config(
            RolloutServiceConfig, {"model_path": "/m", "workers": 2, "gpus_per_worker": 0.5}
        )
    assert RolloutServiceConfig(model_path="/m", workers=1, gpus_per_worker=0.5).workers == 1
