"""Policy losses by config name (``actor.policy_loss``): one registry, filled by
:func:`register_policy_loss` on each entry, which also records the entry's note and its
default clip range.

Every entry has the uniform :class:`PolicyLoss` signature, so the actor passes all its
knobs and never branches on the name; each entry's adapter passes its loss the knobs it
reads (listed once, there). The entries are registered in the order
``rlserve config --describe`` lists them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from rlserve.core.algos.covariance_losses import clip_cov_loss, kl_cov_loss
from rlserve.core.algos.dppo_losses import dppo_kl_loss, dppo_tv_loss
from rlserve.core.algos.notes import AlgorithmNote, Registry
from rlserve.core.algos.policy_losses import (
    cispo_loss,
    gmpo_loss,
    gspo_loss,
    policy_loss,
    reinforce_loss,
    sapo_loss,
)


class PolicyLoss(Protocol):
    """Uniform signature of the entries of :data:`POLICY_LOSSES`.

    Each loss reads the knobs it has and ignores the others: ``clip_ratio_low/high``
    (vanilla, gspo, cispo, gmpo, clip_cov; the divergence thresholds of dppo_tv and
    dppo_kl; None = the loss's own default, :func:`resolve_clip_ratios`),
    ``clip_ratio_dual`` (vanilla), ``clip_cov_fraction``/``clip_cov_low``/
    ``clip_cov_high``/``generator`` (clip_cov), ``kl_cov_fraction``/``kl_cov_coef``
    (kl_cov), ``sapo_tau_pos``/``sapo_tau_neg`` (sapo), ``dppo_max_ratio`` (dppo_tv,
    dppo_kl); ``loss_agg_mode`` (all).
    """

    def __call__(
        self,
        old_logprob: Tensor,
        logprob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        *,
        clip_ratio_low: float | None = None,
        clip_ratio_high: float | None = None,
        clip_ratio_dual: float | None = None,
        loss_agg_mode: str = "token-mean",
        clip_cov_fraction: float = 2e-4,
        clip_cov_low: float = 1.0,
        clip_cov_high: float = 5.0,
        kl_cov_fraction: float = 2e-3,
        kl_cov_coef: float = 1.0,
        sapo_tau_pos: float = 1.0,
        sapo_tau_neg: float = 1.05,
        dppo_max_ratio: float = 20.0,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


LossInputs = tuple[Tensor, Tensor, Tensor, Tensor]
"""``(old_logprob, logprob, advantages, response_mask)``, each Shape: (B, T)."""

LossResult = tuple[Tensor, dict[str, Tensor]]
"""``(loss, metrics)``: the 0-dim loss and its detached 0-dim metrics."""


@dataclass(frozen=True)
class PolicyLossKnobs:
    """The knobs of one :class:`PolicyLoss` call, the clip range resolved
    (:func:`resolve_clip_ratios`); :class:`PolicyLoss` says which loss reads which."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_dual: float | None = None
    loss_agg_mode: str = "token-mean"
    clip_cov_fraction: float = 2e-4
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_fraction: float = 2e-3
    kl_cov_coef: float = 1.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dppo_max_ratio: float = 20.0
    generator: torch.Generator | None = None


LossAdapter = Callable[[LossInputs, PolicyLossKnobs], LossResult]
"""What :func:`register_policy_loss` decorates: one loss called with the knobs it reads."""


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


PPO_CLIP_RATIOS = (0.2, 0.2)
"""PPO's clip range: the default of the losses that follow its paper, and the value a
loss without a clip of its own is given (:func:`resolve_clip_ratios`)."""

POLICY_LOSSES: Registry[RegisteredPolicyLoss] = Registry("policy loss")
"""Policy losses by config name (``actor.policy_loss``), all with the :class:`PolicyLoss`
signature; "vanilla" is :func:`policy_loss`."""


def register_policy_loss(
    name: str, *, note: AlgorithmNote, default_clip_ratios: tuple[float, float] | None = None
) -> Callable[[LossAdapter], LossAdapter]:
    """Decorator: register the decorated adapter as policy loss ``name``, behind the
    uniform :class:`PolicyLoss` signature, described by ``note``; ``default_clip_ratios``
    as :attr:`RegisteredPolicyLoss.default_clip_ratios`."""

    def register(adapter: LossAdapter) -> LossAdapter:
        entry = RegisteredPolicyLoss(_uniform(name, adapter), note, default_clip_ratios)
        POLICY_LOSSES.add(name, entry)
        return adapter

    return register


def _uniform(name: str, adapter: LossAdapter) -> PolicyLoss:
    """``adapter`` behind the :class:`PolicyLoss` signature: the clip range resolved for
    loss ``name``, the other knobs gathered into :class:`PolicyLossKnobs`."""

    def entry(
        old_logprob: Tensor,
        logprob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        *,
        clip_ratio_low: float | None = None,
        clip_ratio_high: float | None = None,
        **knobs: Any,
    ) -> LossResult:
        low, high = resolve_clip_ratios(name, clip_ratio_low, clip_ratio_high)
        return adapter(
            (old_logprob, logprob, advantages, response_mask),
            PolicyLossKnobs(clip_ratio_low=low, clip_ratio_high=high, **knobs),
        )

    entry.__name__ = f"_{name}_policy_loss"
    return entry


@register_policy_loss(
    "vanilla",
    note=AlgorithmNote(
        "PPO clipped surrogate on token ratios, optional dual clip (actor.clip_ratio_dual)",
        'Schulman et al. 2017, "Proximal Policy Optimization", arXiv:1707.06347; dual clip: '
        "Ye et al. 2020, arXiv:1912.09729",
    ),
    default_clip_ratios=PPO_CLIP_RATIOS,
)
def _vanilla(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return policy_loss(
        *inputs,
        clip_ratio_low=knobs.clip_ratio_low,
        clip_ratio_high=knobs.clip_ratio_high,
        clip_ratio_dual=knobs.clip_ratio_dual,
        loss_agg_mode=knobs.loss_agg_mode,
    )


@register_policy_loss(
    "gspo",
    note=AlgorithmNote(
        "one ratio per sequence (geometric mean of token ratios), clipped per sequence; "
        "use tiny clip ratios (3e-4/4e-4) and seq-mean-token-mean",
        'Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071',
    ),
    default_clip_ratios=(3e-4, 4e-4),
)
def _gspo(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return gspo_loss(
        *inputs,
        clip_ratio_low=knobs.clip_ratio_low,
        clip_ratio_high=knobs.clip_ratio_high,
        loss_agg_mode=knobs.loss_agg_mode,
    )


@register_policy_loss(
    "cispo",
    note=AlgorithmNote(
        "REINFORCE term weighted by the clipped, stop-gradient ratio: clipped tokens "
        "keep their gradient",
        'MiniMax 2025, "MiniMax-M1", arXiv:2506.13585',
    ),
    default_clip_ratios=PPO_CLIP_RATIOS,
)
def _cispo(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return cispo_loss(
        *inputs,
        clip_ratio_low=knobs.clip_ratio_low,
        clip_ratio_high=knobs.clip_ratio_high,
        loss_agg_mode=knobs.loss_agg_mode,
    )


@register_policy_loss(
    "gmpo",
    note=AlgorithmNote(
        "geometric mean of log-space-clipped token ratios per sequence; paper's clip "
        "range (e^-0.4, e^0.4) is clip_ratio_low 0.33, clip_ratio_high 0.49",
        'Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673',
    ),
    default_clip_ratios=(1 - math.exp(-0.4), math.exp(0.4) - 1),
)
def _gmpo(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return gmpo_loss(
        *inputs,
        clip_ratio_low=knobs.clip_ratio_low,
        clip_ratio_high=knobs.clip_ratio_high,
        loss_agg_mode=knobs.loss_agg_mode,
    )


@register_policy_loss(
    "clip_cov",
    note=AlgorithmNote(
        "PPO clip, and a random few tokens with advantage-logprob covariance in "
        "(clip_cov_low, clip_cov_high) get no gradient",
        'Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617',
    ),
    default_clip_ratios=PPO_CLIP_RATIOS,
)
def _clip_cov(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return clip_cov_loss(
        *inputs,
        clip_ratio_low=knobs.clip_ratio_low,
        clip_ratio_high=knobs.clip_ratio_high,
        cov_fraction=knobs.clip_cov_fraction,
        cov_low=knobs.clip_cov_low,
        cov_high=knobs.clip_cov_high,
        loss_agg_mode=knobs.loss_agg_mode,
        generator=knobs.generator,
    )


@register_policy_loss(
    "kl_cov",
    note=AlgorithmNote(
        "unclipped surrogate, plus kl_cov_coef·|log ratio| on the top kl_cov_fraction "
        "tokens by advantage-logprob covariance",
        'Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617',
    ),
)
def _kl_cov(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return kl_cov_loss(
        *inputs,
        cov_fraction=knobs.kl_cov_fraction,
        kl_cov_coef=knobs.kl_cov_coef,
        loss_agg_mode=knobs.loss_agg_mode,
    )


@register_policy_loss(
    "reinforce",
    note=AlgorithmNote(
        "-A·ratio, no clip: REINFORCE's gradient on-policy, importance-weighted after",
        'Williams 1992, "Simple Statistical Gradient-Following Algorithms"',
    ),
)
def _reinforce(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return reinforce_loss(
        *inputs,
        loss_agg_mode=knobs.loss_agg_mode,
    )


@register_policy_loss(
    "sapo",
    note=AlgorithmNote(
        "soft gate (4/τ)·σ(τ(ratio-1)) instead of a clip, τ = actor.sapo_tau_pos/neg by "
        "the advantage's sign; use seq-mean-token-mean",
        'Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347',
    ),
)
def _sapo(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return sapo_loss(
        *inputs,
        tau_pos=knobs.sapo_tau_pos,
        tau_neg=knobs.sapo_tau_neg,
        loss_agg_mode=knobs.loss_agg_mode,
    )


@register_policy_loss(
    "dppo_tv",
    note=AlgorithmNote(
        "policy gradient only where the token's probability moved less than "
        "clip_ratio_low/high (total variation, default 0.15), ratio capped at "
        "actor.dppo_max_ratio",
        'Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv:2602.04879',
    ),
    default_clip_ratios=(0.15, 0.15),
)
def _dppo_tv(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return dppo_tv_loss(
        *inputs,
        clip_ratio_low=knobs.clip_ratio_low,
        clip_ratio_high=knobs.clip_ratio_high,
        max_ratio=knobs.dppo_max_ratio,
        loss_agg_mode=knobs.loss_agg_mode,
    )


@register_policy_loss(
    "dppo_kl",
    note=AlgorithmNote(
        "dppo_tv with the binary KL of the token's probability as the trust region (default 0.05)",
        'Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv:2602.04879',
    ),
    default_clip_ratios=(0.05, 0.05),
)
def _dppo_kl(inputs: LossInputs, knobs: PolicyLossKnobs) -> LossResult:
    return dppo_kl_loss(
        *inputs,
        clip_ratio_low=knobs.clip_ratio_low,
        clip_ratio_high=knobs.clip_ratio_high,
        max_ratio=knobs.dppo_max_ratio,
        loss_agg_mode=knobs.loss_agg_mode,
    )


POLICY_LOSS_NOTES: dict[str, AlgorithmNote] = {
    name: entry.note for name, entry in POLICY_LOSSES.items()
}
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
