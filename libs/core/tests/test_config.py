"""Config loading, overrides, derived checks and error messages (CPU, no services)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pydantic
import pytest

from rlserve.core.algos.advantage_registry import (
    ADVANTAGE_ESTIMATOR_NOTES,
    ADVANTAGE_ESTIMATORS,
    needs_critic,
)
from rlserve.core.algos.aggregation import LOSS_AGG_MODE_NOTES, LOSS_AGG_MODES
from rlserve.core.algos.kl import KL_KIND_NOTES, KL_KINDS
from rlserve.core.algos.policy_loss_registry import (
    POLICY_LOSS_NOTES,
    POLICY_LOSSES,
    resolve_clip_ratios,
)
from rlserve.core.config import (
    ConfigError,
    ConfigModel,
    apply_overrides,
    describe_config,
    dump_config,
    fields_from,
    load_config,
    validate_config,
)
from rlserve.core.inputs_config import data_format
from rlserve.core.run_config import (
    EMBEDDED_DAPO_CONFIG_PATH,
    EMBEDDED_DEFAULT_CONFIG_PATH,
    EMBEDDED_GRPO_CONFIG_PATH,
    RewardConfig,
    RunConfig,
)

# GRPO's recipe, the one copy docs/algorithms.md and the benchmarks use too.
GRPO = EMBEDDED_GRPO_CONFIG_PATH


def load(*overrides: str, path: Path | None = None) -> RunConfig:
    return load_config(RunConfig, path, overrides)


def error_of(*overrides: str, path: Path | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(*overrides, path=path)
    return info.value


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# --- the example and the defaults -------------------------------------------------------


def test_example_yaml_loads_and_states_the_defaults():
    config = load_config(RunConfig, EMBEDDED_DEFAULT_CONFIG_PATH)
    assert config == RunConfig()


def test_defaults_are_the_measured_ppo_recipe():
    c = RunConfig()
    assert (c.trainer.prompts_per_step, c.rollout.responses_per_prompt) == (256, 1)
    assert c.rollout.max_new_tokens == 4
    assert (c.actor.lr, c.critic.lr) == (2e-4, 1e-3)
    assert (c.algorithm.kl_ctrl.kl_coef, c.algorithm.kl_penalty) == (0.02, "k1")
    assert (c.algorithm.gamma, c.algorithm.lam) == (1.0, 0.95)
    assert c.algorithm.whiten_advantages
    # unset clip ratios are the loss's own: PPO's 0.2 for the default 'vanilla'
    assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high) == (None, None)
    assert resolve_clip_ratios(c.actor.policy_loss, None, None) == (0.2, 0.2)
    assert c.actor.ppo_epochs == 2
    assert (c.model.tiny.hidden_size, c.model.tiny.num_layers) == (128, 4)
    assert (c.data.arithmetic.train_pairs, c.data.arithmetic.eval_pairs) == (8000, 2000)
    assert c.reward.kinds.rule.rule_name == "arithmetic_exact_match"
    assert (c.reward.kinds.model, c.reward.kinds.http) == (None, None)


def test_derived_sizes():
    c = RunConfig()
    assert c.samples_per_step == 256
    assert c.needs_critic and c.needs_reference
    g = load(path=GRPO)
    assert g.samples_per_step == 64 * 8
    assert g.actor_mini_batch_samples == 16 * 8
    assert not g.needs_critic
    assert g.needs_reference  # through the KL loss


def test_grpo_recipe_changes_only_what_grpo_needs():
    g = load(path=GRPO)
    assert g.algorithm.adv_estimator == "grpo" and not g.needs_critic
    # the KL moves from the reward into the actor loss
    assert g.algorithm.kl_ctrl.kl_coef == 0 and g.actor.use_kl_loss
    default = RunConfig()
    for section in ("model", "data", "critic", "reference", "reward", "placement"):
        assert getattr(g, section) == getattr(default, section), section


# Issue 15's recipes on top of the GRPO one (settings only; their learning is not measured
# here): GSPO with the paper's sequence-ratio clip, Dr. GRPO (no std, constant
# normaliser), GPG (its advantage with plain policy gradient), CISPO.
RECIPES = {
    "gspo": [
        "actor.policy_loss=gspo",
        "actor.clip_ratio_low=3e-4",
        "actor.clip_ratio_high=4e-4",
        "actor.loss_agg_mode=seq-mean-token-mean",
    ],
    "dr_grpo": [
        "algorithm.norm_adv_by_std_in_grpo=false",
        "actor.loss_agg_mode=seq-mean-token-sum-norm",
    ],
    "gpg": ["algorithm.adv_estimator=gpg", "actor.policy_loss=reinforce", "actor.ppo_epochs=1"],
    "cispo": ["actor.policy_loss=cispo", "actor.clip_ratio_low=0.9", "actor.clip_ratio_high=4.0"],
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_catalogue_recipes_are_valid(recipe):
    config = load(*RECIPES[recipe], path=GRPO)
    assert not config.needs_critic


def test_every_field_is_documented():
    undocumented = [
        line for line in describe_config(RunConfig).splitlines() if "undocumented" in line
    ]
    assert undocumented == []


def test_config_is_frozen():
    with pytest.raises(pydantic.ValidationError):
        RunConfig().actor.lr = 1.0  # type: ignore[misc]


# --- overrides --------------------------------------------------------------------------


def test_overrides_parse_yaml_values():
    c = load(
        "actor.lr=1e-3",  # YAML 1.1 would read this as a string
        "trainer.total_steps=7",
        "actor.use_kl_loss=true",
        "actor.clip_ratio_dual=3.0",
        "data.train_path=/data/train.parquet",
        "trainer.ray_address=null",
    )
    assert c.actor.lr == 1e-3 and isinstance(c.actor.lr, float)
    assert c.trainer.total_steps == 7
    assert c.actor.use_kl_loss is True
    assert c.actor.clip_ratio_dual == 3.0
    assert c.data.train_path == "/data/train.parquet" and c.data.train_format == "parquet"
    assert c.trainer.ray_address is None


def test_override_null_resets_an_optional_field(tmp_path):
    path = write(tmp_path, "model:\n  path: /models/x\n")
    assert load_config(RunConfig, path).model.path == "/models/x"
    assert load_config(RunConfig, path, ["model.path=null"]).model.path is None


def test_override_list_values_and_later_wins():
    data = apply_overrides({"a": {"b": 1}}, ["a.c=[1, 2]", "a.b=2", "a.b=3", "x.y.z=ok"])
    assert data == {"a": {"b": 3, "c": [1, 2]}, "x": {"y": {"z": "ok"}}}


def test_apply_overrides_does_not_mutate_its_input():
    data = {"a": {"b": 1}}
    apply_overrides(data, ["a.b=2"])
    assert data == {"a": {"b": 1}}


@pytest.mark.parametrize("bad", ["actor.lr", "=1", "actor..lr=1", "actor.lr=[1"])
def test_malformed_override(bad):
    err = error_of(bad)
    assert repr(bad) in str(err)


def test_override_through_a_non_mapping_names_it():
    err = error_of("trainer.seed=1", "trainer.seed.value=1")
    assert err.paths == ("trainer.seed",)
    assert "is 1, not a mapping" in str(err)


# --- validation errors ------------------------------------------------------------------


def test_unknown_key_suggests_the_field():
    err = error_of("actor.lr_rate=1e-3")
    assert err.paths == ("actor.lr_rate",)
    assert "unknown field" in str(err) and "did you mean 'actor.lr'?" in str(err)


def test_unknown_key_suggests_the_renamed_field():
    err = error_of("model.tiny.sft_steps=100")
    assert "did you mean 'model.tiny.sft_max_steps'?" in str(err)


def test_unknown_key_suggests_the_same_name_in_another_section():
    err = error_of("actor.temperature=0.7")
    assert "did you mean 'rollout.temperature'?" in str(err)


def test_unknown_key_without_a_close_match_lists_the_fields():
    err = error_of("reward.kinds.rule.zzz=1", path=EMBEDDED_DEFAULT_CONFIG_PATH)
    assert err.paths == ("reward.kinds.rule.zzz",)
    assert "time_budget_s" in str(err)


def test_bad_type_names_field_and_value():
    err = error_of("trainer.total_steps=many")
    assert err.paths == ("trainer.total_steps",)
    assert "'many'" in str(err)


def test_bad_literal_and_bounds_are_all_reported():
    err = error_of("algorithm.adv_estimator=ppo", "rollout.top_p=0", "rollout.top_k=0")
    assert set(err.paths) == {"algorithm.adv_estimator", "rollout.top_p", "rollout.top_k"}
    assert "3 problems" in str(err)


def test_algorithm_names_come_from_the_algos_registries():
    # every registered name is accepted where its family is chosen
    for estimator in ADVANTAGE_ESTIMATORS:
        config = load(
            f"algorithm.adv_estimator={estimator}",
            "rollout.responses_per_prompt=8",
            "trainer.prompts_per_step=64",
            "actor.ppo_mini_batch_prompts=16",
            "critic.ppo_mini_batch_prompts=16",
        )
        assert config.needs_critic == needs_critic(estimator)
    for loss in POLICY_LOSSES:
        assert load(f"actor.policy_loss={loss}").actor.policy_loss == loss
    for kind in KL_KINDS:
        c = load(f"algorithm.kl_penalty={kind}", f"actor.kl_loss_kind={kind}")
        assert (c.algorithm.kl_penalty, c.actor.kl_loss_kind) == (kind, kind)
    for mode in LOSS_AGG_MODES:
        assert load(f"actor.loss_agg_mode={mode}").actor.loss_agg_mode == mode
    assert RunConfig().actor.policy_loss == "vanilla"
    assert RunConfig().algorithm.norm_adv_by_std_in_grpo
    assert RunConfig().algorithm.singleton_groups == "zero"


def test_unknown_algorithm_names_list_the_valid_choices():
    err = error_of(
        "actor.policy_loss=ppo",
        "algorithm.kl_penalty=k4",
        "actor.kl_loss_kind=k2+",
        "actor.loss_agg_mode=sum",
        "algorithm.singleton_groups=raw",
    )
    assert set(err.paths) == {
        "actor.policy_loss",
        "algorithm.kl_penalty",
        "actor.kl_loss_kind",
        "actor.loss_agg_mode",
        "algorithm.singleton_groups",
    }
    text = str(err)
    assert "'vanilla', 'gspo', 'cispo', 'gmpo', 'reinforce', 'sapo', 'clip_cov', 'kl_cov'" in text
    assert "'dppo_tv' or 'dppo_kl'" in text
    assert "'k1+', 'k3+' or 'low_var_kl+'" in text
    # the critic implements only the first three aggregation modes
    assert error_of("critic.loss_agg_mode=token-sum").paths == ("critic.loss_agg_mode",)


def test_loss_knobs_that_would_do_nothing_are_errors():
    err = error_of("actor.policy_loss=gspo", "actor.clip_ratio_dual=3")
    assert err.paths == ("actor.clip_ratio_dual",)
    assert "'vanilla' only" in str(err)
    assert error_of("actor.clip_cov_low=5", "actor.clip_cov_high=1").paths == (
        "actor.clip_cov_high",
    )
    # GRPO's std division has its own switch; the old spelling fails instead of silently
    # changing meaning
    err = error_of("algorithm.whiten_advantages=false", path=GRPO)
    assert err.paths == ("algorithm.whiten_advantages",)
    assert "norm_adv_by_std_in_grpo=false" in str(err)
    assert not load(
        "algorithm.norm_adv_by_std_in_grpo=false", path=GRPO
    ).algorithm.norm_adv_by_std_in_grpo


def test_describe_lists_every_algorithm_choice_with_its_paper():
    text = describe_config(RunConfig)
    families = {
        "algorithm.adv_estimator": ADVANTAGE_ESTIMATOR_NOTES,
        "actor.policy_loss": POLICY_LOSS_NOTES,
        "algorithm.kl_penalty": KL_KIND_NOTES,
        "actor.kl_loss_kind": KL_KIND_NOTES,
        "actor.loss_agg_mode": LOSS_AGG_MODE_NOTES,
    }
    lines = text.splitlines()
    for field, notes in families.items():
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{field}:"))
        listed = lines[start + 2 : start + 2 + len(notes)]
        assert listed == [f"      {name}: {note.line()}" for name, note in notes.items()], field
    assert "      gspo: one ratio per sequence" in text
    assert "arXiv:2507.18071" in text


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(RunConfig, write(tmp_path, "- actor\n- critic\n"))


def test_yaml_syntax_error_and_duplicate_key(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(RunConfig, write(tmp_path, "actor: [1,\n"))
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        load_config(RunConfig, write(tmp_path, "actor:\n  lr: 1\n  lr: 2\n"))


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(RunConfig, tmp_path / "nope.yaml")
    assert load_config(RunConfig, write(tmp_path, "")) == RunConfig()


def test_data_suffix_is_validated():
    err = error_of("data.eval_path=eval.csv")
    assert err.paths == ("data.eval_path",) and ".jsonl or .parquet" in str(err)
    assert data_format("x/train.JSONL") == "jsonl"


# --- derived checks ---------------------------------------------------------------------


def test_mini_batch_must_divide_prompts_per_step():
    err = error_of("actor.ppo_mini_batch_prompts=100")
    assert err.paths == ("actor.ppo_mini_batch_prompts",)
    assert "must divide trainer.prompts_per_step (256); got 100" in str(err)
    assert "64 or 128" in str(err)  # the fix


def test_critic_mini_batch_checked_only_when_gae_uses_it():
    err = error_of("critic.ppo_mini_batch_prompts=100")
    assert err.paths == ("critic.ppo_mini_batch_prompts",)
    c = load("critic.ppo_mini_batch_prompts=100", path=GRPO)
    assert not c.needs_critic


def test_micro_batch_must_divide_each_workers_share():
    err = error_of("actor.micro_batch_samples=48")
    assert err.paths == ("actor.micro_batch_samples",)
    # 64 prompts × 1 response over 2 workers = 32 samples each; a set 64 no longer fits
    err = error_of("actor.workers=2", "actor.micro_batch_samples=64")
    assert err.paths == ("actor.micro_batch_samples",)
    assert "32 samples" in str(err) and "actor.workers 2" in str(err)
    assert load("actor.workers=2", "actor.micro_batch_samples=16").actor.workers == 2


def test_unset_batch_sizes_follow_the_ones_set():
    """A user who sets one size is not made to set three (the real-model command of
    docs/real-models.md set only trainer.prompts_per_step=8 and failed twice)."""
    small = load("trainer.prompts_per_step=8", "rollout.responses_per_prompt=4")
    assert (small.actor.ppo_mini_batch_prompts, small.actor.micro_batch_samples) == (8, 32)
    assert (small.critic.ppo_mini_batch_prompts, small.critic.micro_batch_samples) == (8, 32)
    # a worker's share that 64 does not divide: its largest divisor up to 64
    odd = load("trainer.prompts_per_step=96", "actor.workers=2")
    assert (odd.actor.ppo_mini_batch_prompts, odd.actor.micro_batch_samples) == (48, 24)
    assert load("actor.workers=2").actor.micro_batch_samples == 32
    # a size that is set stays as set, and the defaults stay where they fit
    assert (
        load("trainer.prompts_per_step=8", "actor.micro_batch_samples=2").actor.micro_batch_samples
        == 2
    )
    assert load("trainer.prompts_per_step=128").actor.ppo_mini_batch_prompts == 64
    # a section the caller passes in is not changed under it (sections are shared)
    from rlserve.core.run_config import ActorConfig

    shared = ActorConfig()
    eight = RunConfig.model_validate({"actor": shared, "trainer": {"prompts_per_step": 8}})
    sixteen = RunConfig.model_validate({"actor": shared, "trainer": {"prompts_per_step": 16}})
    assert (eight.actor.ppo_mini_batch_prompts, sixteen.actor.ppo_mini_batch_prompts) == (8, 16)
    assert shared.ppo_mini_batch_prompts == 64


def test_workers_must_split_the_mini_batch_evenly():
    err = error_of("critic.workers=3")
    assert err.paths == ("critic.workers",)
    assert "equal share" in str(err)


def test_requests_over_a_services_max_request_tokens_are_refused_before_any_cluster():
    """Issue 12 defect 7: the services refuse requests over max_request_tokens; a run
    whose own requests they would refuse fails here, naming each field and the fix."""
    # PPO: 256 samples × (64 + 4) = 17,408 positions (evaluation: 500 × 68); GRPO: 512 × 68
    assert load().rollout.max_request_tokens == 262_144
    assert load(path=GRPO).samples_per_step * (64 + 4) < 262_144
    # four responses per prompt at the default 256 prompts still fit
    assert load("rollout.responses_per_prompt=4").samples_per_step * (64 + 4) == 69_632
    err = error_of("rollout.max_new_tokens=1000")  # 1064 positions per sequence
    assert err.paths == (
        "rollout.max_request_tokens",
        "critic.max_request_tokens",
        "reference.max_request_tokens",
    )
    assert "500 rows from rollout.eval_prompts (evaluation)" in str(err)
    assert "raise it to at least 532000" in str(err)  # 500 × 1064
    assert "raise it to at least 272384" in str(err)  # 256 × 1064
    raised = load(
        "rollout.max_new_tokens=1000",
        "rollout.max_request_tokens=532000",
        "critic.max_request_tokens=272384",
        "reference.max_request_tokens=272384",
    )
    assert raised.rollout.max_request_tokens == 532_000
    # no evaluation set: only the step counts for the rollout
    err = error_of("rollout.max_new_tokens=1000", "data.train_path=t.jsonl")
    assert "at least 272384" in str(err) and "eval_prompts" not in str(err)


def test_group_estimators_need_several_responses():
    for estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        err = error_of(f"algorithm.adv_estimator={estimator}")
        assert err.paths == ("rollout.responses_per_prompt",)
        assert estimator in str(err)
    assert not load("algorithm.adv_estimator=reinforce_plus_plus").needs_critic


def test_greedy_group_sampling_is_rejected():
    err = error_of("rollout.temperature=0", path=GRPO)
    assert err.paths == ("rollout.temperature",)
    assert load("rollout.temperature=0").rollout.temperature == 0  # fine for PPO


def test_dapo_settings_are_checked_against_the_run():
    err = error_of("algorithm.dynamic_sampling=true")  # the default run is PPO with GAE
    assert err.paths == ("algorithm.dynamic_sampling",) and "'gae'" in str(err)
    dapo = load(
        "algorithm.dynamic_sampling=true",
        "algorithm.overlong_buffer_tokens=2",
        "algorithm.filter_overlong=true",
        path=GRPO,
    )
    assert dapo.algorithm.dynamic_sampling_max_rounds == 4
    recipe = load(path=EMBEDDED_DAPO_CONFIG_PATH)  # all four pieces on
    assert recipe.algorithm.dynamic_sampling and recipe.algorithm.filter_overlong
    assert recipe.algorithm.overlong_buffer_tokens == 4 and recipe.rollout.max_new_tokens == 8
    assert recipe.actor.clip_ratio_high > recipe.actor.clip_ratio_low
    assert recipe.actor.loss_agg_mode == "token-mean"
    cap = dapo.rollout.max_new_tokens
    err = error_of(f"algorithm.overlong_buffer_tokens={cap + 1}", path=GRPO)
    assert err.paths == ("algorithm.overlong_buffer_tokens",)
    assert f"rollout.max_new_tokens ({cap})" in str(err)


def test_section_checks_are_rooted_at_the_section():
    assert error_of("actor.clip_ratio_dual=1.0").paths == ("actor.clip_ratio_dual",)
    assert error_of("model.tiny.num_heads=3").paths == ("model.tiny.num_heads",)
    assert error_of("actor.use_kl_loss=true", "actor.kl_loss_coef=0").paths == (
        "actor.kl_loss_coef",
    )
    assert error_of("data.arithmetic.train_pairs=9000").paths == ("data.arithmetic.train_pairs",)


@pytest.mark.parametrize(
    ("override", "place"),
    [
        ("reward.kind=model", "reward.kinds.<kind>"),
        ("reward.rule_name=gsm8k", "reward.kinds.rule.rule_name"),
        ("reward.model_path=/rm", "reward.kinds.model.model_path"),
        ("reward.http.url=http://x", "reward.kinds.http"),
        ("reward.autoscaling.max_replicas=3", "reward.autoscaling_config"),
        ("actor.logprob_micro_batch_samples=8", "forward_micro_batch_samples"),
        ("reference.micro_batch_samples=8", "forward_micro_batch_samples"),
        ("rollout.workers=2", "actor.workers"),
    ],
)
def test_a_former_field_names_its_new_place(override, place):
    err = error_of(override)
    section, former = override.split("=")[0].split(".")[:2]
    assert err.paths == (f"{section}.{former}",)
    assert f"no longer a field; set {place}" in str(err)


def test_reward_kinds_combine_and_at_least_one_is_set():
    # the embedded configs list their rule, so a kind set on the command line joins it
    config = load(
        "reward.kinds.model.model_path=/models/rm",
        "reward.kinds.model.weight=0.5",
        path=EMBEDDED_DEFAULT_CONFIG_PATH,
    )
    assert config.reward.kinds.weights() == {"rule": 1.0, "model": 0.5}
    alone = load("reward.kinds.rule=null", "reward.kinds.http.url=http://verifier:8000/score")
    assert alone.reward.kinds.weights() == {"http": 1.0}
    err = error_of("reward.kinds.rule=null")
    assert err.paths == ("reward.kinds",) and "set at least one of rule, model, http" in str(err)


def test_section_validates_on_its_own():
    # A service that embeds one section gets the same checks and paths relative to it.
    with pytest.raises(ConfigError) as info:
        validate_config(RewardConfig, {"kinds": {"http": {"url": "ftp://x"}}})
    assert info.value.paths == ("kinds.http.url",)
    assert validate_config(RewardConfig, {"kinds": {"http": {"url": "http://x"}}})


# --- dump and describe ------------------------------------------------------------------


def test_dump_load_round_trip(tmp_path):
    config = load(
        "actor.lr=1e-5",
        "data.eval_path=e.jsonl",
        "actor.clip_ratio_dual=3",
        "actor.grad_clip=.inf",
        "data.prompt_key='1e-3'",
        path=GRPO,
    )
    path = write(tmp_path, dump_config(config))
    assert load_config(RunConfig, path) == config
    assert load_config(RunConfig, write(tmp_path, dump_config(RunConfig()))) == RunConfig()


def test_describe_lists_nested_fields_with_docstrings():
    text = describe_config(RunConfig)
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("reward.kinds.http.timeout_s:"))
    assert lines[i] == "reward.kinds.http.timeout_s: float = 3.0  (> 0)"
    assert lines[i + 1].strip() == (
        "Per-request timeout in seconds (connect + response), for every attempt."
    )
    assert (
        "actor.loss_agg_mode: 'token-mean' | 'seq-mean-token-sum' | 'seq-mean-token-mean'" in text
    )
    assert "reward.kinds.http: section HttpKindConfig | None" in text


def test_config_model_base_settings():
    class Tiny(ConfigModel):
        x: int = 1
        """An x."""

    assert Tiny.model_fields["x"].description == "An x."
    with pytest.raises(ConfigError, match="x: Input should be a valid integer"):
        validate_config(Tiny, {"x": "one"})
    with pytest.raises(ConfigError) as info:
        validate_config(Tiny, {"y": 2})
    assert "did you mean 'x'" not in str(info.value)  # too far from 'x' to guess


def test_settings_json_redacts_secret_fields():
    import json

    from rlserve.core.config import SECRET, ConfigModel, settings_json

    class Api(ConfigModel):
        url: str
        """Endpoint."""
        headers: dict[str, str] = pydantic.Field(default_factory=dict, json_schema_extra=SECRET)
        """Secret headers."""

    class Service(ConfigModel):
        apis: list[Api]
        """APIs."""
        lr: float = 0.1
        """Learning rate."""

    config = Service(apis=[Api(url="http://x", headers={"Authorization": "Bearer s3cret"})])
    text = settings_json(config)
    assert "s3cret" not in text
    assert json.loads(text) == {
        "apis": [{"url": "http://x", "headers": "<redacted>"}],
        "lr": 0.1,
    }
    # An empty secret shows as empty: nothing to hide.
    assert json.loads(settings_json(Api(url="u")))["headers"] == {}


def test_catalogue_settings_are_checked_against_the_run():
    err = error_of("algorithm.rollout_is_cap=2.0", "actor.policy_loss=kl_cov", path=GRPO)
    assert err.paths == ("algorithm.rollout_is_cap",) and "'kl_cov'" in str(err)
    assert load("algorithm.rollout_is_cap=2.0", path=GRPO).algorithm.rollout_is_cap == 2.0
    assert error_of("algorithm.rollout_is_cap=0").paths == ("algorithm.rollout_is_cap",)
    err = error_of("algorithm.adv_estimator=remax", "rollout.temperature=0")
    assert err.paths == ("rollout.temperature",) and "'remax'" in str(err)
    # ReMax's baseline is the greedy response, not the group: one response per prompt is fine
    assert load("algorithm.adv_estimator=remax").rollout.responses_per_prompt == 1
    err = error_of("algorithm.adv_estimator=gdpo")  # a group estimator, default n = 1
    assert err.paths == ("rollout.responses_per_prompt",)
    sapo = load("actor.policy_loss=sapo", "actor.sapo_tau_neg=2.0")
    assert (sapo.actor.sapo_tau_pos, sapo.actor.sapo_tau_neg) == (1.0, 2.0)
    assert error_of("actor.dppo_max_ratio=0").paths == ("actor.dppo_max_ratio",)


def test_one_step_off_always_corrects_for_its_stale_samples():
    assert load().rollout_is_cap is None  # sync: off unless asked for
    assert load("rollout.mode=one_step_off").rollout_is_cap == 2.0
    assert load("rollout.mode=one_step_off", "algorithm.rollout_is_cap=1.5").rollout_is_cap == 1.5
    err = error_of("rollout.mode=one_step_off", "actor.policy_loss=clip_cov", path=GRPO)
    assert err.paths == ("rollout.mode",) and "'clip_cov'" in str(err)
    assert error_of("rollout.mode=async").paths == ("rollout.mode",)


def test_fields_from_copies_same_named_fields_and_takes_overrides():
    @dataclasses.dataclass(frozen=True)
    class Plain:
        lr: float
        depth: int

    class Section(ConfigModel):
        lr: float = 0.5
        depth: int = 3
        unused: str = "x"

    assert fields_from(Plain, Section()) == Plain(lr=0.5, depth=3)
    assert fields_from(Plain, Section(), depth=7) == Plain(lr=0.5, depth=7)
    with pytest.raises(TypeError, match=r"Plain has no field\(s\) \['width'\]"):
        fields_from(Plain, Section(), width=1)

    class Narrow(ConfigModel):
        lr: float = 0.5

    with pytest.raises(AttributeError, match=r"Plain\.depth: Narrow has no field 'depth'"):
        fields_from(Plain, Narrow())
