"""VllmConfig: the vLLM engine section of the run config (`rollout.vllm`) (CPU, no vLLM)."""

from __future__ import annotations

import pytest

from rlserve.core.config import ConfigError, load_config, validate_config
from rlserve.core.run_config import RunConfig
from rlserve.core.vllm_config import VllmConfig


def load(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, overrides)


def test_defaults_fit_a_shared_cpu_box_and_a_shared_gpu():
    vllm = load().rollout.vllm
    assert vllm == VllmConfig()
    assert vllm.model_dump() == {
        "kv_cache_gib": 1.0,
        "gpu_memory_utilization": 0.5,
        "max_model_len": None,
        "enforce_eager": None,
        "sleep_while_training": False,
    }


def test_overrides_reach_the_section():
    vllm = load(
        "rollout.vllm.kv_cache_gib=null",
        "rollout.vllm.gpu_memory_utilization=0.3",
        "rollout.vllm.enforce_eager=false",
        "rollout.vllm.sleep_while_training=true",
    ).rollout.vllm
    assert vllm.kv_cache_gib is None and vllm.gpu_memory_utilization == 0.3
    assert (vllm.enforce_eager, vllm.sleep_while_training) == (False, True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.vllm.gpu_memory_utilization=0", "greater than 0"),
        ("rollout.vllm.gpu_memory_utilization=1.5", "less than or equal to 1"),
        ("rollout.vllm.kv_cache_gib=0", "greater than 0"),
        ("rollout.vllm.max_model_len=0", "greater than or equal to 1"),
    ],
)
def test_out_of_range_values_name_the_field(override, message):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{field}: .*{message}") as error:
        load(override)
    assert error.value.paths == (field,)


def test_tensor_parallel_size_is_not_a_setting():
    # The in-process single executor cannot span GPUs (see vllm_config's docstring).
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.tensor_parallel_size: unknown field"):
        load("rollout.vllm.tensor_parallel_size=2")


def test_max_model_len_must_hold_prompt_and_response_for_vllm():
    overrides = ["data.max_prompt_tokens=64", "rollout.max_new_tokens=16"]
    with pytest.raises(ConfigError, match=r"raise it to at least 80") as error:
        load(*overrides, "rollout.engine=vllm", "rollout.vllm.max_model_len=79")
    assert error.value.paths == ("rollout.vllm.max_model_len",)
    assert load(*overrides, "rollout.engine=vllm", "rollout.vllm.max_model_len=80")
    # Not checked when vLLM is not the engine (the section is unused then).
    assert load(*overrides, "rollout.engine=hf", "rollout.vllm.max_model_len=79")


def test_gpu_memory_utilization_must_leave_room_on_the_rollout_gpu_share():
    """Issue 30, defect 5: vLLM starts only when its fraction of the GPU is free, and the
    actor's training copy is already there (same process); placed on half a GPU, a
    fraction of 0.5 cannot start. Refused before any cluster starts, naming the field."""
    half_gpu = [
        "rollout.engine=vllm",
        "placement.pools={gpu: {}}",
        "placement.roles={rollout: {pool: gpu, worker_resources: {CPU: 1, GPU: 0.5}}}",
    ]
    with pytest.raises(ConfigError, match=r"0\.5 leaves no room .* set it below 0\.5") as error:
        load(*half_gpu, "rollout.vllm.gpu_memory_utilization=0.5")
    assert error.value.paths == ("rollout.vllm.gpu_memory_utilization",)
    assert load(*half_gpu, "rollout.vllm.gpu_memory_utilization=0.25")
    # A whole GPU per worker (no placement): everything but the training copy's room.
    with pytest.raises(ConfigError, match=r"1 leaves no room .*a whole GPU"):
        load("rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=1")
    assert load("rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.9")
    # Not on CPU workers, nor when vLLM is not the engine.
    assert load(*half_gpu, "rollout.vllm.gpu_memory_utilization=0.5", "actor.device=cpu")
    assert load(*half_gpu[1:], "rollout.engine=hf", "rollout.vllm.gpu_memory_utilization=0.5")


def test_model_dump_validates_back_to_the_same_section():
    """What the trainer sends the rollout service is the dump; the service reads it back."""
    vllm = VllmConfig(kv_cache_gib=None, gpu_memory_utilization=0.4, max_model_len=1024)
    assert validate_config(VllmConfig, vllm.model_dump()) == vllm
