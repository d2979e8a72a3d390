"""The ratio-based policy losses (PPO clip with dual clip, GSPO, CISPO, GMPO,
REINFORCE, SAPO), and the input checks and metrics every policy loss shares.

Each takes the sampling policy's and the current policy's log-probs, the advantages and
the response mask, and returns the aggregated loss and the metrics of
:func:`policy_metrics`. The actor reaches them by name through
:mod:`rlserve.core.algos.policy_loss_registry`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlserve.core.algos.aggregation import aggregate_loss
from rlserve.core.algos.masked import (
    check_2d,
    check_same_shape,
    clamped_log_ratio,
    inside_mask,
    masked_mean,
)
from rlserve.core.algos.notes import AlgorithmNote
from rlserve.core.algos.policy_loss_registry import PPO_CLIP_RATIOS, register_policy_loss


def check_policy_inputs(
    old_log_probs: Tensor, log_probs: Tensor, advantages: Tensor, response_mask: Tensor
) -> None:
    check_2d("log_probs", log_probs)
    check_same_shape(
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        response_mask=response_mask,
    )


def check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0 <= clip_ratio_low < 1:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def policy_metrics(
    loss: Tensor,
    log_ratio: Tensor,
    mask: Tensor,
    clipfrac: Tensor | None = None,
    clipfrac_lower: Tensor | None = None,
) -> dict[str, Tensor]:
    """The metrics every policy loss reports (0 for a clip it does not have)."""
    return {
        "pg_loss": loss.detach(),
        "pg_clipfrac": (_zero(loss) if clipfrac is None else clipfrac).detach(),
        # first-order estimate of KL(π_old ‖ π_θ) from samples of π_old
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
        "pg_clipfrac_lower": (_zero(loss) if clipfrac_lower is None else clipfrac_lower).detach(),
    }


@register_policy_loss(
    "vanilla",
    note=AlgorithmNote(
        "PPO clipped surrogate on token ratios, optional dual clip (actor.clip_ratio_dual)",
        'Schulman et al. 2017, "Proximal Policy Optimization", arXiv:1707.06347; dual clip: '
        "Ye et al. 2020, arXiv:1912.09729",
    ),
    default_clip_ratios=PPO_CLIP_RATIOS,
)
def policy_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_dual: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss (Schulman et al., 2017) with dual clip (Ye et al., 2020).

    Registered as "vanilla" in :data:`POLICY_LOSSES`. With ratio ρ = π_θ/π_old per token::

        L = max(-A·ρ, -A·clip(ρ, 1 - ε_low, 1 + ε_high))
        L = min(L, -A·c)   where A < 0   (dual clip, c = clip_ratio_dual > 1)

    The dual clip bounds the loss of tokens with negative advantage whose ratio has
    grown huge (stale samples), which the plain clip leaves unbounded.

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: ε_low, the ratio is clipped below at 1 - ε_low.
        clip_ratio_high: ε_high, the ratio is clipped above at 1 + ε_high (DAPO's
            "clip-higher" sets it larger than ε_low).
        clip_ratio_dual: c > 1, or ``None`` to disable the dual clip.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``; ``loss`` Shape: (). ``metrics`` (detached, 0-dim):

        - ``"pg_loss"``: the loss.
        - ``"pg_clipfrac"``: fraction of response tokens where the ε clip is active.
        - ``"ppo_kl"``: approx. KL(π_old ‖ π_θ) = masked mean of old - new log-prob.
        - ``"pg_clipfrac_lower"``: fraction of response tokens where the dual clip is
          active (0 when disabled).

        Every loss in :data:`POLICY_LOSSES` reports these four keys.

    Raises:
        ValueError: On bad shapes, bad clip ratios, an unknown mode or an empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    check_clip_ratios(clip_ratio_low, clip_ratio_high)
    if clip_ratio_dual is not None and clip_ratio_dual <= 1:
        raise ValueError(f"clip_ratio_dual must be > 1 (or None), got {clip_ratio_dual}")
    mask = response_mask.bool()
    # log ρ, clamped so exp() cannot overflow on garbage or wildly stale tokens
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    # unclipped surrogate, negated so that minimising it ascends the objective
    unclipped = -advantages * ratio
    # surrogate with ρ kept in the trust region [1 - ε_low, 1 + ε_high]
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    # pessimistic bound: take the larger loss (= smaller objective)
    losses = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).to(log_probs.dtype), mask)
    if clip_ratio_dual is None:
        clipfrac_lower = None
    else:
        # dual clip: for A < 0 the loss -A·ρ grows without bound in ρ; cap it at -A·c
        dual_bound = -advantages * clip_ratio_dual
        negative = advantages < 0
        clipfrac_lower = masked_mean(((losses > dual_bound) & negative).to(log_probs.dtype), mask)
        losses = torch.where(negative, torch.minimum(losses, dual_bound), losses)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, policy_metrics(loss, log_ratio, mask, clipfrac, clipfrac_lower)


@register_policy_loss(
    "gspo",
    note=AlgorithmNote(
        "one ratio per sequence (geometric mean of token ratios), clipped per sequence; "
        "use tiny clip ratios (3e-4/4e-4) and seq-mean-token-mean",
        'Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071',
    ),
    default_clip_ratios=(3e-4, 4e-4),
)
def gspo_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: one importance ratio per sequence (Zheng et al., 2025, "Group Sequence
    Policy Optimization", arXiv:2507.18071), in its GSPO-token form.

    The sequence ratio is the geometric mean of the token ratios,
    ``s_i = exp(mean_t log ρ_{i,t})``, clipped like PPO's but per sequence. Each token
    carries ``s_{i,t} = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)]``: the value of s_i, the
    gradient ``s_i·∇log π_θ(y_t)``::

        L_{i,t} = max(-A_{i,t}·s_{i,t}, -A_{i,t}·clip(s_{i,t}, 1 - ε_low, 1 + ε_high))

    With one advantage per sequence (outcome estimators) and the default
    "seq-mean-token-mean" aggregation this is exactly GSPO's sequence objective
    ``-(1/G) Σ_i min(s_i A_i, clip(s_i) A_i)`` and its gradient; token-level
    advantages are allowed (the GSPO-token variant). The paper's clip range is tiny
    (ε_low = 3e-4, ε_high = 4e-4, the defaults here): a sequence ratio moves far less
    than a token ratio. No dual clip.

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: ε_low: s_i is clipped below at 1 - ε_low.
        clip_ratio_high: ε_high: s_i is clipped above at 1 + ε_high.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`; ``"pg_clipfrac"`` is the fraction of
        response tokens whose sequence's clip is active.

    Raises:
        ValueError: On bad shapes, bad clip ratios, an unknown mode or an empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    check_clip_ratios(clip_ratio_low, clip_ratio_high)
    mask = response_mask.bool()
    old_log_probs, log_probs, advantages = inside_mask(mask, old_log_probs, log_probs, advantages)
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    # log s_i: the mean token log-ratio of each sequence (0 for a row without tokens)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=1)
    # value log s_i on every token, gradient ∇log π_θ(y_t) (log_probs - sg[log_probs] = 0)
    token_log_ratio = seq_log_ratio.detach()[:, None] + (log_probs - log_probs.detach())
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    # pessimistic bound per token, with the sequence's ratio
    losses = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).to(log_probs.dtype), mask)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, policy_metrics(loss, log_ratio, mask, clipfrac)


@register_policy_loss(
    "cispo",
    note=AlgorithmNote(
        "REINFORCE term weighted by the clipped, stop-gradient ratio: clipped tokens "
        "keep their gradient",
        'MiniMax 2025, "MiniMax-M1", arXiv:2506.13585',
    ),
    default_clip_ratios=PPO_CLIP_RATIOS,
)
def cispo_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: clip the importance weight, not the update (MiniMax, 2025, "MiniMax-M1",
    arXiv:2506.13585).

    ``ŵ = sg[clip(ρ, 1 - ε_low, 1 + ε_high)]`` weights a REINFORCE term, and no gradient
    flows through the clip, so every token keeps its gradient (PPO's clip drops the
    gradient of clipped tokens entirely)::

        L_t = -ŵ_t · A_t · π_θ(y_t)/sg[π_θ(y_t)]

    The gradient is the paper's ``-ŵ·A·∇log π_θ``; the value is ``-ŵ·A`` (the paper
    writes ``-ŵ·A·log π_θ``, same gradient, a value that depends on the log-probs'
    size). The paper bounds the weight only above; set ``clip_ratio_low`` close to 1 to
    leave the lower side nearly open. Token-mean aggregation is the paper's.

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: ε_low: the weight is at least 1 - ε_low.
        clip_ratio_high: ε_high: the weight is at most 1 + ε_high.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`; ``"pg_clipfrac"`` is the fraction of
        response tokens whose weight was clipped (either side).

    Raises:
        ValueError: On bad shapes, bad clip ratios, an unknown mode or an empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    check_clip_ratios(clip_ratio_low, clip_ratio_high)
    mask = response_mask.bool()
    old_log_probs, log_probs, advantages = inside_mask(mask, old_log_probs, log_probs, advantages)
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    # the clipped importance weight, a constant for the gradient
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    # value 1, gradient ∇log π_θ: a REINFORCE term weighted by ŵ·A
    score_function = torch.exp(log_probs - log_probs.detach())
    losses = -advantages * weight * score_function
    clipfrac = masked_mean((weight != ratio.detach()).to(log_probs.dtype), mask)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, policy_metrics(loss, log_ratio, mask, clipfrac)


@register_policy_loss(
    "gmpo",
    note=AlgorithmNote(
        "geometric mean of log-space-clipped token ratios per sequence; paper's clip "
        "range (e^-0.4, e^0.4) is clip_ratio_low 0.33, clip_ratio_high 0.49",
        'Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673',
    ),
    default_clip_ratios=(1 - math.exp(-0.4), math.exp(0.4) - 1),
)
def gmpo_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 1 - math.exp(-0.4),
    clip_ratio_high: float = math.exp(0.4) - 1,
    loss_agg_mode: str = "seq-mean-token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: the geometric mean of clipped token ratios per sequence (Zhao et al.,
    2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673).

    Token ratios are clipped in log space to ``[log(1 - ε_low), log(1 + ε_high)]``,
    pessimistically for the advantage's sign, and averaged over the sequence's tokens
    before the exp, so one outlier token moves the sequence ratio by only its share::

        r⁺_i = exp(mean_t min(log ρ_{i,t}, clip(log ρ_{i,t})))    (for A > 0)
        r⁻_i = exp(mean_t max(log ρ_{i,t}, clip(log ρ_{i,t})))    (for A < 0)
        L_{i,t} = -A_{i,t} · r^{sign A_{i,t}}_i

    With one advantage per sequence and "seq-mean-token-mean" (the defaults) this is
    the paper's objective ``(1/G) Σ_i A_i·(Π_t clipped ρ)^{1/|y_i|}``; token-level
    advantages pick the ratio of their own sign. The default ε's are the paper's range
    (e^-0.4, e^0.4) written as ratio bounds 1 - ε_low and 1 + ε_high.

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: ε_low: token ratios are clipped below at 1 - ε_low.
        clip_ratio_high: ε_high: token ratios are clipped above at 1 + ε_high.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`; ``"pg_clipfrac"`` is the fraction of
        response tokens whose clip is active on their advantage's side.

    Raises:
        ValueError: On bad shapes, bad clip ratios, an unknown mode or an empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    check_clip_ratios(clip_ratio_low, clip_ratio_high)
    mask = response_mask.bool()
    old_log_probs, log_probs, advantages = inside_mask(mask, old_log_probs, log_probs, advantages)
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    low, high = math.log(1 - clip_ratio_low), math.log(1 + clip_ratio_high)
    clipped = torch.clamp(log_ratio, low, high)
    # pessimistic per sign: A > 0 must not gain from a ratio above 1 + ε_high, A < 0 from
    # one below 1 - ε_low
    seq_ratio_pos = torch.exp(masked_mean(torch.minimum(log_ratio, clipped), mask, dim=1))
    seq_ratio_neg = torch.exp(masked_mean(torch.maximum(log_ratio, clipped), mask, dim=1))
    positive = advantages > 0
    ratio = torch.where(positive, seq_ratio_pos[:, None], seq_ratio_neg[:, None])
    losses = -advantages * ratio
    active = (positive & (log_ratio > high)) | ((advantages < 0) & (log_ratio < low))
    clipfrac = masked_mean(active.to(log_probs.dtype), mask)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, policy_metrics(loss, log_ratio, mask, clipfrac)


@register_policy_loss(
    "reinforce",
    note=AlgorithmNote(
        "-A·ratio, no clip: REINFORCE's gradient on-policy, importance-weighted after",
        'Williams 1992, "Simple Statistical Gradient-Following Algorithms"',
    ),
)
def reinforce_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain policy gradient, importance-weighted, no clip (REINFORCE: Williams, 1992,
    "Simple Statistical Gradient-Following Algorithms"; GPG's loss, arXiv:2504.02546).

    ``L_t = -A_t · ρ_t``. On the first mini-batch of a step ρ = 1 and the gradient is
    REINFORCE's ``-A·∇log π_θ``, the same as the ``-A·log π_θ`` form; unlike that form,
    ρ keeps later mini-batches and epochs unbiased (off-policy correction) and the
    value is ``-A`` rather than a log-prob-sized number. Nothing bounds ρ: use one
    epoch and one mini-batch per step to stay on-policy.

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss` (both clip fractions 0).

    Raises:
        ValueError: On bad shapes, an unknown mode or an empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    mask = response_mask.bool()
    old_log_probs, log_probs, advantages = inside_mask(mask, old_log_probs, log_probs, advantages)
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    losses = -advantages * torch.exp(log_ratio)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, policy_metrics(loss, log_ratio, mask)


@register_policy_loss(
    "sapo",
    note=AlgorithmNote(
        "soft gate (4/τ)·σ(τ(ratio-1)) instead of a clip, τ = actor.sapo_tau_pos/neg by "
        "the advantage's sign; use seq-mean-token-mean",
        'Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347',
    ),
)
def sapo_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    loss_agg_mode: str = "seq-mean-token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a soft, temperature-controlled gate in place of the hard clip (Gao et al.,
    2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347).

    Each token's ratio passes through ``f(ρ) = (4/τ)·σ(τ·(ρ - 1))``, with τ = τ_pos for
    A > 0 and τ_neg otherwise::

        L_t = -f(ρ_t)·A_t

    At ρ = 1 the gate's slope is 1, so an on-policy step is plain policy gradient; as ρ
    leaves 1 the gradient ``A·4σ(1-σ)·ρ·∇log π`` decays smoothly instead of being cut
    off. A larger τ_neg damps negative-advantage tokens faster (the paper's finding:
    they destabilise training more). The paper aggregates per sequence, the default.

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        sapo_tau_pos: Gate temperature for positive advantages (> 0).
        sapo_tau_neg: Gate temperature for zero or negative advantages (> 0).
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss` (both clip fractions 0: nothing is
        clipped).

    Raises:
        ValueError: On bad shapes, a temperature <= 0, an unknown mode or an empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(
            f"sapo_tau_pos and sapo_tau_neg must be > 0, got {sapo_tau_pos} and {sapo_tau_neg}"
        )
    mask = response_mask.bool()
    old_log_probs, log_probs, advantages = inside_mask(mask, old_log_probs, log_probs, advantages)
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.full_like(ratio, sapo_tau_pos),
        torch.full_like(ratio, sapo_tau_neg),
    )
    # the soft gate: value 1 and slope 1 at ρ = 1, flat far from it
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    losses = -gate * advantages
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, policy_metrics(loss, log_ratio, mask)
