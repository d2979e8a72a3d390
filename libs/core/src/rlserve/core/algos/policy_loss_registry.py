"""Policy losses by config name (``actor.policy_loss``): one registry, filled by
:func:`register_policy_loss` on each loss function, which also records the loss's note
and its default clip range.

A loss's keyword parameters are its knobs, named as the actor's settings name them
(``clip_ratio_low``, ``sapo_tau_pos``, ...): the registered entry takes the actor's
settings as one mapping and hands each loss the knobs its signature names, so a new knob
is a settings field and a parameter of the same name, and nothing in between. The
losses register when ``rlserve.core.algos`` is imported (its ``__init__`` imports their
modules), in the order ``rlserve config --describe`` lists them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from rlserve.core.algos.notes import AlgorithmNote, Registry, RegistryNotes

_CLIP_KNOBS = ("clip_ratio_low", "clip_ratio_high")


class PolicyLoss(Protocol):
    """Uniform signature of the entries of :data:`POLICY_LOSSES`: the four (B, T)
    inputs, then ``knobs``, the actor's settings by name (each loss reads those its
    signature names; one not given keeps the loss's own default, the clip range its
    entry's :attr:`~RegisteredPolicyLoss.default_clip_ratios`), and the random
    ``generator`` of a loss that samples tokens (clip_cov)."""

    def __call__(
        self,
        old_log_probs: Tensor,
        log_probs: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        knobs: Mapping[str, Any] | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


LossFunction = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""What :func:`register_policy_loss` decorates: ``(old_log_probs, log_probs, advantages,
response_mask, *, <knobs>)``."""


@dataclass(frozen=True)
class RegisteredPolicyLoss:
    """One entry of :data:`POLICY_LOSSES`."""

    loss: PolicyLoss
    """The loss, with the uniform :class:`PolicyLoss` signature."""
    note: AlgorithmNote
    """What it computes, in one line, and its paper."""
    default_clip_ratios: tuple[float, float] | None
    """(clip_ratio_low, clip_ratio_high) the loss uses when the config leaves them unset:
    its paper's values (PPO's 0.2; GSPO's sequence-ratio range; GMPO's (e^-0.4, e^0.4);
    DPPO's divergence thresholds). None for a loss without a clip (kl_cov, reinforce,
    sapo)."""
    knob_names: tuple[str, ...]
    """The actor settings the loss reads (its keyword parameters)."""


PPO_CLIP_RATIOS = (0.2, 0.2)
"""PPO's clip range: the default of the losses that follow its paper, and the value a
loss without a clip of its own is given (:func:`resolve_clip_ratios`)."""

POLICY_LOSSES: Registry[RegisteredPolicyLoss] = Registry("policy loss")
"""Policy losses by config name (``actor.policy_loss``), all with the :class:`PolicyLoss`
signature; "vanilla" is :func:`policy_loss`."""


def register_policy_loss(
    name: str, *, note: AlgorithmNote, default_clip_ratios: tuple[float, float] | None = None
) -> Callable[[LossFunction], LossFunction]:
    """Decorator: register the decorated loss as policy loss ``name``, behind the uniform
    :class:`PolicyLoss` signature, described by ``note``; ``default_clip_ratios`` as
    :attr:`RegisteredPolicyLoss.default_clip_ratios`. The loss itself is returned as it
    is, to be called with its own keywords."""

    def register(loss: LossFunction) -> LossFunction:
        entry = RegisteredPolicyLoss(
            _uniform(name, loss), note, default_clip_ratios, loss_knob_names(loss)
        )
        POLICY_LOSSES.add(name, entry)
        return loss

    return register


def loss_knob_names(loss: LossFunction) -> tuple[str, ...]:
    """The knobs ``loss`` reads: its keyword-only parameters but the generator."""
    return tuple(
        parameter.name
        for parameter in inspect.signature(loss).parameters.values()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.name != "generator"
    )


def _uniform(name: str, loss: LossFunction) -> PolicyLoss:
    """``loss`` behind the :class:`PolicyLoss` signature: the clip range resolved for
    loss ``name``, then the knobs its signature names taken from ``knobs``."""
    knob_names = loss_knob_names(loss)
    reads_clip = set(_CLIP_KNOBS) <= set(knob_names)
    takes_generator = "generator" in inspect.signature(loss).parameters

    def entry(
        old_log_probs: Tensor,
        log_probs: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        knobs: Mapping[str, Any] | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        knobs = knobs or {}
        given = {key: knobs[key] for key in knob_names if key in knobs}
        if reads_clip:
            low, high = resolve_clip_ratios(
                name, knobs.get("clip_ratio_low"), knobs.get("clip_ratio_high")
            )
            given.update(clip_ratio_low=low, clip_ratio_high=high)
        if takes_generator:
            given["generator"] = generator
        return loss(old_log_probs, log_probs, advantages, response_mask, **given)

    entry.__name__ = f"_{name}_policy_loss"
    return entry


POLICY_LOSS_NOTES: Mapping[str, AlgorithmNote] = RegistryNotes(POLICY_LOSSES)
"""One line per policy loss, with its paper (the run config's choices)."""


def resolve_clip_ratios(
    policy_loss_name: str, clip_ratio_low: float | None, clip_ratio_high: float | None
) -> tuple[float, float]:
    """The clip range ``policy_loss_name`` trains with: each value given, else the loss's
    default (its entry's ``default_clip_ratios``; PPO's 0.2 for a loss that reads no
    clip). ValueError naming the valid choices for an unknown name."""
    defaults = POLICY_LOSSES.lookup(policy_loss_name).default_clip_ratios
    default_low, default_high = PPO_CLIP_RATIOS if defaults is None else defaults
    return (
        default_low if clip_ratio_low is None else clip_ratio_low,
        default_high if clip_ratio_high is None else clip_ratio_high,
    )


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; ValueError naming the valid choices if none."""
    return POLICY_LOSSES.lookup(name).loss
