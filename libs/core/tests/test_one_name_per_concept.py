"""One name per concept from the run config to the math: a policy-loss knob is called
the same in the actor's settings, in the worker that passes them on, and in the loss
function that reads it (the registry hands each loss its knobs by name)."""

from rlserve.core.algos.policy_loss_registry import POLICY_LOSSES
from rlserve.core.worker_settings import ActorSettings

KNOB_PREFIXES = ("clip_ratio_", "clip_cov_", "kl_cov_", "sapo_", "dppo_")


def test_every_knob_a_loss_reads_is_an_actor_setting_of_that_name():
    for name, entry in POLICY_LOSSES.items():
        unknown = sorted(set(entry.knob_names) - set(ActorSettings.model_fields))
        assert not unknown, f"policy loss {name!r} reads {unknown}, which no actor setting is"


def test_every_loss_setting_of_the_actor_reaches_a_loss():
    read = {knob for _, entry in POLICY_LOSSES.items() for knob in entry.knob_names}
    settings = {field for field in ActorSettings.model_fields if field.startswith(KNOB_PREFIXES)}
    assert settings, "no actor setting looks like a policy-loss knob: KNOB_PREFIXES is stale"
    assert settings <= read, f"actor settings no loss reads: {sorted(settings - read)}"
    assert "loss_agg_mode" in read
