"""Run config → each service's deploy args: pools become shared placement groups with
per-role bundle offsets, reward gets its pool's nodes and its scaling; `rlserve service
scale` edits only what it should."""

import os

import pytest

from rlserve.core.config import ConfigError, validate_config
from rlserve.core.inputs_config import LARGE_MODEL_WEIGHT_BYTES
from rlserve.core.run_config import RunConfig
from rlserve.trainer.deploy import service_args, share_gpus
from rlserve.trainer.service_ops import scaled_app

GPU = {"CPU": 2, "GPU": 1}


def _config(**placement_and_more) -> RunConfig:
    reward = placement_and_more.pop("reward", {})
    return validate_config(
        RunConfig,
        {
            "actor": {"workers": 2, "micro_batch_samples": 16},
            "critic": {"workers": 1},
            "reward": reward,
            "placement": placement_and_more,
        },
    )


def test_roles_in_one_pool_share_its_group_with_their_own_bundles():
    config = _config(
        pools={
            "global_pool": {
                "label_selector": {"rlserve.io/pool": "gpu"},
                "strategy": "STRICT_PACK",
            },
            "reward_pool": {"label_selector": {"rlserve.io/pool": "cheap"}},
        },
        roles={
            "rollout": {"pool": "global_pool", "worker_resources": GPU},
            "critic": {"pool": "global_pool", "worker_resources": {"CPU": 1, "GPU_group": 0.5}},
            "reference": {"pool": "global_pool", "worker_resources": GPU},
            "reward": {"pool": "reward_pool", "worker_resources": {"CPU": 0.5, "cheap_cpu": 1}},
        },
        timeout_s=30,
    )
    apps = service_args(config, "/models/policy")
    bundles = [GPU, GPU, {"CPU": 1, "GPU_group": 0.5}, GPU]
    for role, offset in (("rollout", 0), ("critic", 2), ("reference", 3)):
        placement = apps[role]["placement"]
        assert placement == {
            "group_name": "rlserve-global_pool",
            "pool": "global_pool",
            "bundles": bundles,
            "bundle_offset": offset,
            "strategy": "STRICT_PACK",
            "label_selector": {"rlserve.io/pool": "gpu"},
            "timeout_s": 30,
        }
    assert apps["rollout"]["num_cpus_per_worker"] == 2
    assert apps["reward"]["placement"] == {
        "label_selector": {"rlserve.io/pool": "cheap"},
        "resources": {"cheap_cpu": 1},
    }
    assert apps["reward"]["num_cpus_per_replica"] == 0.5


def test_roles_in_different_pools_get_different_groups():
    config = _config(
        pools={"actor_pool": {"strategy": "STRICT_PACK"}, "critic_pool": {"strategy": "SPREAD"}},
        roles={"rollout": {"pool": "actor_pool"}, "critic": {"pool": "critic_pool"}},
    )
    apps = service_args(config, "/m")
    assert apps["rollout"]["placement"]["group_name"] == "rlserve-actor_pool"
    assert apps["critic"]["placement"]["group_name"] == "rlserve-critic_pool"
    assert apps["critic"]["placement"]["bundle_offset"] == 0
    assert "placement" not in apps["reference"]  # left to Ray
    assert "placement" not in apps["reward"]


def test_no_placement_section_leaves_every_service_to_ray():
    apps = service_args(_config(), "/m")
    assert not any("placement" in args for args in apps.values())


def test_request_limits_reach_the_services():
    config = validate_config(
        RunConfig,
        {
            "rollout": {"max_request_tokens": 100_000},
            "critic": {"max_request_tokens": 90_000},
            "reference": {"max_request_tokens": 80_000},
        },
    )
    apps = service_args(config, "/m")
    limits = {role: apps[role]["max_request_tokens"] for role in ("rollout", "critic", "reference")}
    assert limits == {"rollout": 100_000, "critic": 90_000, "reference": 80_000}


def test_reward_scaling_reaches_the_service():
    auto = {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 2}
    apps = service_args(_config(reward={"autoscaling_config": auto}), "/m")
    assert apps["reward"]["autoscaling_config"]["max_replicas"] == 8
    assert apps["reward"]["num_replicas"] is None
    apps = service_args(_config(reward={"num_replicas": 4}), "/m")
    assert apps["reward"]["num_replicas"] == 4


@pytest.mark.parametrize(
    ("placement", "path", "message"),
    [
        (
            {"pools": {}, "roles": {"rollout": {"pool": "gpu"}}},
            "placement.roles.rollout.pool",
            "no pool 'gpu'",
        ),
        (
            {
                "pools": {"c": {}},
                "roles": {"reward": {"pool": "c", "worker_resources": {"GPU": 1}}},
            },
            "placement.roles.reward.worker_resources.GPU",
            "reward never takes a GPU",
        ),
        (
            {
                "pools": {"c": {}},
                "roles": {"rollout": {"pool": "c", "worker_resources": {"CPU": 0}}},
            },
            "placement.roles.rollout.worker_resources",
            "asks for nothing",
        ),
    ],
)
def test_bad_placement_is_a_config_error_naming_the_field(placement, path, message):
    with pytest.raises(ConfigError) as error:
        validate_config(RunConfig, {"placement": placement})
    assert any(p == path and message in m for p, m in error.value.issues), error.value.issues


def test_reward_scaling_excludes_a_fixed_count():
    with pytest.raises(ConfigError, match="set either num_replicas or autoscaling"):
        validate_config(
            RunConfig,
            {"reward": {"num_replicas": 2, "autoscaling_config": {"max_replicas": 4}}},
        )


def test_scale_switches_between_fixed_and_autoscaling_and_refuses_stateful_apps():
    app = {"name": "reward", "args": {"kinds": {}, "num_replicas": 1}}
    auto = scaled_app(app, None, 2, 8, 3.0)
    assert "num_replicas" not in auto["args"]
    assert auto["args"]["autoscaling_config"] == {
        "min_replicas": 2,
        "max_replicas": 8,
        "target_ongoing_requests": 3.0,
    }
    assert app["args"]["num_replicas"] == 1  # the declared config is not edited in place
    fixed = scaled_app(auto, 4, None, None, None)
    assert fixed["args"]["num_replicas"] == 4 and "autoscaling_config" not in fixed["args"]
    with pytest.raises(ConfigError, match="scale its data-parallel workers instead"):
        scaled_app({"name": "rollout", "args": {}}, 2, None, None, None)
    with pytest.raises(ConfigError, match="--replicas excludes --min/--max"):
        scaled_app(app, 2, 1, 4, None)


def test_settings_differences_lists_each_changed_setting():
    from rlserve.trainer.deploy import IMPORT_PATHS, settings_differences

    wanted = service_args(_config(), "/m")
    deployed = {
        "rollout": {
            "import_path": IMPORT_PATHS["rollout"],
            "args": {**wanted["rollout"], "forward_micro_batch_samples": 4, "lr": 1.0},
        },
        "critic": {"import_path": IMPORT_PATHS["critic"], "args": dict(wanted["critic"])},
        "reward": {"import_path": "my.reward:app", "args": {}},
    }
    assert settings_differences(wanted, deployed) == [
        f"rollout.forward_micro_batch_samples: deployed 4, run wants "
        f"{wanted['rollout']['forward_micro_batch_samples']}",
        f"rollout.lr: deployed 1.0, run wants {wanted['rollout']['lr']}",
        f"reward: import_path 'my.reward:app', run wants '{IMPORT_PATHS['reward']}'",
    ]
    # A setting the deployed app has and the run does not set is a difference too.
    deployed["critic"]["args"]["extra_knob"] = 1
    assert settings_differences({"critic": wanted["critic"]}, deployed) == [
        "critic.extra_knob: deployed 1, run wants '<unset>'"
    ]
    assert settings_differences(wanted, {}) == []


def test_settings_differences_never_print_a_secret():
    from rlserve.trainer.deploy import IMPORT_PATHS, settings_differences

    def reward_with(token):
        kinds = {"http": {"url": "http://api", "headers": {"Authorization": token}}}
        return service_args(_config(reward={"kinds": kinds}), "/m")["reward"]

    deployed = {"reward": {"import_path": IMPORT_PATHS["reward"], "args": reward_with("old")}}
    (line,) = settings_differences({"reward": reward_with("Bearer s3cret")}, deployed)
    assert line.startswith("reward.kinds: deployed ") and "<redacted>" in line
    assert "s3cret" not in line and "old" not in line


@pytest.fixture(scope="module")
def large_model(tmp_path_factory) -> str:
    """A model directory whose weights count as large (a sparse file: no disk used)."""
    directory = tmp_path_factory.mktemp("large_model")
    with (directory / "model.safetensors").open("wb") as weights:
        weights.truncate(LARGE_MODEL_WEIGHT_BYTES)
    return str(directory)


def _threads(settings: dict, model_dir: str, node_cpus: int = 8) -> dict[str, dict[str, int]]:
    config = validate_config(
        RunConfig, {**settings, "placement": {"node_cpus": node_cpus}, "trainer": {
            "ray_address": "ray://elsewhere:10001", "serve_grpc_port": 9000,
            **settings.get("trainer", {})}}
    )  # fmt: skip
    apps = service_args(config, model_dir)
    return {role: args["stage_threads"] for role, args in apps.items() if "stage_threads" in args}


GRPO_LORA = {
    "algorithm": {"adv_estimator": "grpo", "kl_ctrl": {"kl_coef": 0}},
    "actor": {
        "lora_rank": 8,
        "use_kl_loss": True,
        "ppo_epochs": 1,
        "ppo_mini_batch_prompts": 16,
        "micro_batch_samples": 16,
    },
    "rollout": {"responses_per_prompt": 4},
    "trainer": {"prompts_per_step": 16},
}


def test_a_single_pass_lora_actor_gets_every_core_in_every_stage(large_model):
    # the reference is the actor's own base (merged by default), no log-prob pass
    every_core = {"generate": 8, "forward": 8, "update": 8}
    assert _threads(GRPO_LORA, large_model) == {"rollout": every_core}
    # a small model keeps one thread per worker: threads cost more than they save there
    assert _threads(GRPO_LORA, "/no/such/model") == {}


def test_concurrent_stages_share_the_node_cores(large_model):
    ppo = {
        "algorithm": {"adv_estimator": "gae"},
        "actor": {"workers": 2, "micro_batch_samples": 16},
    }
    threads = _threads(ppo, large_model)
    # generate: 2 rollout workers; forward: log-prob, reference and values (2 + 1 + 1);
    # update: actor and critic (2 + 1)
    assert threads["rollout"] == {"generate": 4, "forward": 2, "update": 2}
    assert threads["critic"] == threads["reference"] == threads["rollout"]
    # a single-pass full-weight GRPO run: the separate reference forwards alone
    full = {**GRPO_LORA, "actor": {**GRPO_LORA["actor"], "lora_rank": 0}}
    assert _threads(full, large_model)["reference"] == {"generate": 8, "forward": 8, "update": 8}


def test_stage_threads_need_known_cores_and_can_be_turned_off(large_model):
    joined = validate_config(
        RunConfig, {"trainer": {"ray_address": "ray://elsewhere:10001", "serve_grpc_port": 9000}}
    )
    assert not any("stage_threads" in a for a in service_args(joined, large_model).values())
    off = validate_config(RunConfig, {"placement": {"stage_threads": False}})
    assert not any("stage_threads" in a for a in service_args(off, large_model).values())
    local = service_args(validate_config(RunConfig, {}), large_model)
    assert local["rollout"]["stage_threads"]["generate"] == len(os.sched_getaffinity(0))


def test_workers_of_a_large_model_keep_freed_pages(large_model):
    ppo = validate_config(RunConfig, {"algorithm": {"adv_estimator": "gae"}})
    for model_dir, keep in ((large_model, True), ("/no/such/model", False)):
        apps = service_args(ppo, model_dir)
        assert {role: args.get("keep_freed_pages") for role, args in apps.items()} == {
            "rollout": keep, "critic": keep, "reference": keep, "reward": None}  # fmt: skip


def test_single_pass_update_only_where_the_update_is_one_on_policy_step():
    def single_pass(**sections) -> bool:
        merged = {key: {**GRPO_LORA.get(key, {}), **sections.get(key, {})} for key in
                  {*GRPO_LORA, *sections}}  # fmt: skip
        return validate_config(RunConfig, merged).single_pass_update

    assert single_pass()
    assert not single_pass(actor={"ppo_epochs": 2})
    assert not single_pass(actor={"ppo_mini_batch_prompts": 8})
    assert not single_pass(actor={"reuse_update_forward": False})
    assert not single_pass(rollout={"mode": "one_step_off"})
    assert not single_pass(algorithm={"rollout_is_cap": 2.0})
    # a KL penalty in the reward reads the old log-probs before the update
    assert not single_pass(actor={"use_kl_loss": False}, algorithm={"kl_ctrl": {"kl_coef": 0.1}})
    assert single_pass(algorithm={"kl_ctrl": {"kl_coef": 0.1}})  # ignored beside a KL loss


def test_a_lora_actor_serves_its_own_reference_unless_told_otherwise():
    lora = validate_config(RunConfig, GRPO_LORA)
    assert lora.reference_merged and "reference" not in service_args(lora, "/m")
    assert service_args(lora, "/m")["rollout"]["serve_reference"]
    separate = validate_config(
        RunConfig, {**GRPO_LORA, "placement": {"reference_in_rollout": False}}
    )
    assert not separate.reference_merged and "reference" in service_args(separate, "/m")
    full = validate_config(
        RunConfig, {**GRPO_LORA, "actor": {**GRPO_LORA["actor"], "lora_rank": 0}}
    )
    assert not full.reference_merged


def test_auto_engine_generates_a_large_model_with_vllm_where_installed(large_model):
    import importlib.util

    small = validate_config(RunConfig, {})
    assert service_args(small, "/m")["rollout"]["engine"] == "hf"
    large = validate_config(RunConfig, {"model": {"path": large_model}})
    expected = "vllm" if importlib.util.find_spec("vllm") else "hf"
    assert service_args(large, large_model)["rollout"]["engine"] == expected
    chosen = validate_config(
        RunConfig, {"model": {"path": large_model}, "rollout": {"engine": "hf"}}
    )
    assert service_args(chosen, large_model)["rollout"]["engine"] == "hf"


def test_every_service_gets_the_runs_auth_mode(tmp_path):
    for mode in ("token", "none"):
        config = validate_config(RunConfig, {"trainer": {"service_auth": mode}})
        args = service_args(config, str(tmp_path))
        assert args and {role: a["auth"] for role, a in args.items()} == dict.fromkeys(args, mode)


def test_a_run_on_a_cluster_without_a_token_stops_before_joining_it(monkeypatch, tmp_path):
    from rlserve.core import auth
    from rlserve.trainer.run import start_ray

    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    config = validate_config(
        RunConfig, {"trainer": {"ray_address": "ray://10.0.0.1:10001", "serve_grpc_port": 9000}}
    )
    with pytest.raises(auth.AuthConfigError, match=r"trainer\.service_auth=none"):
        start_ray(config, tmp_path)  # refused before it tries to reach the address


def test_actor_ranks_on_shares_of_a_gpu_are_refused_naming_actor_workers():
    placement = {
        "pools": {"gpu": {}},
        "roles": {"rollout": {"pool": "gpu", "worker_resources": {"CPU": 1, "GPU": 0.5}}},
    }
    with pytest.raises(ConfigError) as error:
        _config(**placement)
    assert any(
        path == "actor.workers" and "NCCL" in message and "actor.workers: 1" in message
        for path, message in error.value.issues
    ), error.value.issues


def _one_rank_each(**more) -> dict:
    config = validate_config(
        RunConfig,
        {
            "actor": {"workers": 1},
            "critic": {"workers": 1},
            "algorithm": {"kl_ctrl": {"kl_coef": 0.02}},
        }
        | more,
    )
    return service_args(config, "/m")


def test_one_gpu_is_shared_by_every_unplaced_worker():
    apps = _one_rank_each()
    share_gpus(apps, cluster_gpus=1)
    assert {role: apps[role]["gpus_per_worker"] for role in ("rollout", "critic", "reference")} == {
        "rollout": 0.3333,
        "critic": 0.3333,
        "reference": 0.3333,
    }
    apps = _one_rank_each(critic={"workers": 1, "device": "cpu"})
    share_gpus(apps, cluster_gpus=2)
    assert apps["rollout"]["gpus_per_worker"] == apps["reference"]["gpus_per_worker"] == 1.0
    assert "gpus_per_worker" not in apps["critic"]  # a CPU worker reserves none anyway


def test_vllm_memory_beyond_the_rollout_share_of_a_gpu_is_refused_naming_the_field():
    # one GPU, three workers: each gets 1/3, and vLLM's default 0.5 cannot be free there
    apps = _one_rank_each(rollout={"engine": "vllm"})
    with pytest.raises(ConfigError) as error:
        share_gpus(apps, cluster_gpus=1)
    path, message = error.value.issues[0]
    assert path == "rollout.vllm.gpu_memory_utilization"
    assert "0.3333 of one" in message and "below 0.3333" in message
    fits = _one_rank_each(rollout={"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.15}})
    share_gpus(fits, cluster_gpus=1)
    assert fits["rollout"]["gpus_per_worker"] == 0.3333
    share_gpus(_one_rank_each(rollout={"engine": "vllm"}), cluster_gpus=3)  # a GPU each


def test_a_cpu_cluster_leaves_the_args_of_services_deployed_one_by_one():
    # Services deployed alone get service_args only; a run on a cluster without GPUs must
    # find them unchanged and join them (a 0.0 here made it refuse them as changed).
    apps = _one_rank_each()
    before = {role: dict(args) for role, args in apps.items()}
    share_gpus(apps, cluster_gpus=0)
    assert apps == before


def test_training_ranks_that_would_share_a_gpu_are_refused_before_any_service_starts():
    apps = service_args(_config(), "/m")  # actor.workers 2
    with pytest.raises(ConfigError) as error:
        share_gpus(apps, cluster_gpus=1)
    assert error.value.issues[0][0] == "actor.workers"
    with pytest.raises(ConfigError, match=r"actor\.device"):
        share_gpus(_one_rank_each(actor={"workers": 1, "device": "cuda"}), cluster_gpus=0)
