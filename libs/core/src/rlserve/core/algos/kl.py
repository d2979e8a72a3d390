"""KL between the policy and the reference: the per-token estimators, the KL-in-reward
penalty and its metrics, the controllers of its coefficient β, and KL as a loss term."""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.core.algos.aggregation import aggregate_loss
from rlserve.core.algos.masked import LOG_RATIO_CLAMP, check_2d, check_same_shape, masked_mean
from rlserve.core.algos.notes import AlgorithmNote

# VeRL's bound for the k3 estimate: it is non-negative but unbounded, and a handful of
# tokens with a huge ratio would otherwise dominate the batch KL.
_K3_CLAMP = 10.0


_SCHULMAN_KL = 'Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html)'


_STRAIGHT_THROUGH = (
    "value of the named estimator, gradient of k2 = log-ratio·∇log π: the unbiased gradient "
    "of KL(π‖π_ref) on tokens sampled from π"
)


KL_KIND_NOTES: dict[str, AlgorithmNote] = {
    "k1": AlgorithmNote("log-ratio log π/π_ref: unbiased, high variance, can be < 0", _SCHULMAN_KL),
    "kl": AlgorithmNote('"k1" under VeRL\'s name', _SCHULMAN_KL),
    "k2": AlgorithmNote("0.5·log-ratio²: biased, low variance, >= 0", _SCHULMAN_KL),
    "mse": AlgorithmNote('"k2" under VeRL\'s name', _SCHULMAN_KL),
    "k3": AlgorithmNote(
        "π_ref/π - log(π_ref/π) - 1: unbiased, low variance, >= 0, clamped to [-10, 10]",
        _SCHULMAN_KL,
    ),
    "low_var_kl": AlgorithmNote('"k3" under VeRL\'s name', _SCHULMAN_KL),
    "abs": AlgorithmNote("|log-ratio|: biased, robust magnitude", "VeRL's estimator list"),
    "k1+": AlgorithmNote("k1 straight-through: " + _STRAIGHT_THROUGH, _SCHULMAN_KL),
    "k3+": AlgorithmNote("k3 straight-through: " + _STRAIGHT_THROUGH, _SCHULMAN_KL),
    "low_var_kl+": AlgorithmNote('"k3+" under VeRL\'s name', _SCHULMAN_KL),
}
"""Every KL estimator :func:`kl_penalty` accepts, with its one-line description."""


KL_KINDS: tuple[str, ...] = tuple(KL_KIND_NOTES)
"""Names accepted by :func:`kl_penalty` ("kl" = "k1", "mse" = "k2", "low_var_kl" = "k3";
a "+" suffix is the straight-through variant)."""


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from sampled tokens' log-probs.

    Tokens are sampled from π, so with log_ratio = log_probs - ref_log_probs
    (Schulman, "Approximating KL divergence", 2020):

    - ``"k1"`` / ``"kl"``: log_ratio. Unbiased, high variance, can be negative.
    - ``"k2"`` / ``"mse"``: 0.5 * log_ratio². Biased, low variance, >= 0.
    - ``"k3"`` / ``"low_var_kl"``: exp(-log_ratio) + log_ratio - 1. Unbiased, >= 0,
      low variance; clamped to [-10, 10] like VeRL.
    - ``"abs"``: |log_ratio|.
    - ``"k1+"``, ``"k3+"``, ``"low_var_kl+"``: straight-through. The value is the named
      estimator's, the gradient is k2's, ``log_ratio · ∇log_probs``, whose expectation
      under π is the exact gradient of KL(π ‖ π_ref) (k1's gradient has expectation 0,
      k3's is the gradient of the other direction, KL(π_ref ‖ π)). Only matters in a
      loss (:func:`kl_loss`); in the reward the value alone counts.

    Args:
        log_probs: Log-probs under the current (or old) policy, nats. Shape: (B, T).
        ref_log_probs: Log-probs under the reference policy, nats. Shape: (B, T).
        kind: One of :data:`KL_KINDS`.

    Returns:
        Per-token KL estimate in nats (not masked). Shape: (B, T).

    Raises:
        ValueError: On a shape mismatch or an unknown ``kind``.
    """
    check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    log_ratio = log_probs - ref_log_probs
    if kind.endswith("+") and kind in KL_KINDS:
        value = kl_penalty(log_probs, ref_log_probs, kind.removesuffix("+"))
        k2 = 0.5 * log_ratio.square()
        # forward: the estimator's value; backward: k2's gradient (the detached part is 0)
        return k2 + (value - k2).detach()
    if kind in ("k1", "kl"):
        # log π/π_ref: its expectation under π is exactly the KL
        return log_ratio
    if kind in ("k2", "mse"):
        # half squared log-ratio: matches KL to second order, never negative
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # r = π_ref/π; clamp log r so exp() cannot overflow on outlier tokens
        log_r = torch.clamp(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        # r - log r - 1 >= 0 with E_π[r] = 1, so it is unbiased with lower variance
        k3 = torch.exp(log_r) - log_r - 1
        # bound outliers so a few tokens cannot dominate the batch KL
        return torch.clamp(k3, -_K3_CLAMP, _K3_CLAMP)
    if kind == "abs":
        # |log π/π_ref|: a biased but robust magnitude
        return log_ratio.abs()
    raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


def token_rewards_with_kl_penalty(
    scores: Tensor, token_kl: Tensor, response_mask: Tensor, kl_coef: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level rewards: ``-β·KL`` on every response token plus the score at the end.

    This is the RLHF reward of Ziegler et al. (2019) / InstructGPT: the outcome score
    is credited to the last response token of each sequence, and every response token
    pays ``kl_coef * token_kl`` for drifting from the reference policy.

    Args:
        scores: Outcome reward per sequence. Shape: (B,).
        token_kl: Per-token KL estimate (see :func:`kl_penalty`), nats. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        kl_coef: β, reward units per nat of KL (>= 0).

    Returns:
        ``(token_rewards, metrics)``. ``token_rewards`` Shape: (B, T), 0 outside the
        mask; a row with no response token gets no score. ``metrics``: those of
        :func:`kl_metrics` plus ``"kl_coef"``, β as a tensor.

    Raises:
        ValueError: On bad shapes, a negative ``kl_coef`` or an all-zero mask.
    """
    check_2d("token_kl", token_kl)
    check_same_shape(token_kl=token_kl, response_mask=response_mask)
    if scores.shape != token_kl.shape[:1]:
        raise ValueError(
            f"scores must have shape (B,) = ({token_kl.shape[0]},), got {tuple(scores.shape)}"
        )
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    mask = response_mask.bool()
    num_tokens = token_kl.shape[1]
    # KL outside the mask is padding: it must neither be penalised nor averaged
    kl = torch.where(mask, token_kl, torch.zeros_like(token_kl))
    # every response token pays β·KL
    token_rewards = -kl_coef * kl
    # index of the last response token: the largest position whose mask is 1
    positions = torch.arange(num_tokens, device=mask.device).expand_as(mask)
    last_index = torch.where(mask, positions, torch.zeros_like(positions)).amax(dim=1)
    # a row with no response token has nowhere to put its score
    has_response = mask.any(dim=1)
    placed_scores = torch.where(has_response, scores.to(token_rewards.dtype), 0.0)
    # the outcome score is credited once, at the end of the response
    token_rewards = token_rewards.scatter_add(1, last_index[:, None], placed_scores[:, None])
    metrics = kl_metrics(kl, response_mask)
    metrics["kl_coef"] = torch.tensor(float(kl_coef), device=kl.device)
    return token_rewards, metrics


def kl_metrics(token_kl: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """Three averages of a per-token KL, 0-dim and detached.

    - ``"kl_mean"``: mean over sequences of each sequence's mean token KL (nats/token;
      sequences without response tokens left out). Every sequence weighs the same
      whatever its length, as in VeRL: the number an adaptive controller is fed.
    - ``"kl_token_mean"``: mean over all response tokens (long responses weigh more).
    - ``"kl_seq_sum_mean"``: mean over sequences of the summed KL (nats/sequence).

    Shape: token_kl, response_mask (B, T).
    """
    mask = response_mask.bool()
    kl = torch.where(mask, token_kl, torch.zeros_like(token_kl))
    lengths = mask.sum(dim=1)
    has_response = lengths > 0
    per_sequence = kl.sum(dim=1)[has_response] / lengths[has_response]
    return {
        "kl_mean": per_sequence.mean().detach(),
        "kl_token_mean": masked_mean(kl, mask).detach(),
        "kl_seq_sum_mean": kl.sum(dim=1).mean().detach(),
    }


class FixedKLController:
    """A constant KL coefficient β.

    Args:
        kl_coef: β, reward units per nat (>= 0).
    """

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing: β stays fixed. Same signature as the adaptive controller."""
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        """The state to checkpoint: ``{"value": β}``."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore β from :meth:`state_dict` output."""
        self.value = _value_from_state(state)


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), "Fine-Tuning LMs from Human Prefs".

    β is steered so the observed KL tracks ``target_kl``::

        e = clip(current_kl / target_kl - 1, -0.2, 0.2)
        β ← β · (1 + e · n_steps / horizon)

    Args:
        init_kl_coef: Initial β (> 0; β only ever scales, so 0 would stay 0).
        target_kl: KL to track, in the same unit as the ``current_kl`` you feed
            (e.g. nats per sequence, as in the paper, or nats per token).
        horizon: Number of samples over which the error is corrected (> 0).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if init_kl_coef <= 0:
            raise ValueError(f"init_kl_coef must be > 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β towards the value that keeps KL at target.

        Args:
            current_kl: KL measured on the last batch (unit of ``target_kl``).
            n_steps: Samples in that batch (>= 0).
        """
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        # proportional error, clipped so one odd batch cannot swing β by more than 20%
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        # multiplicative update, scaled by how much of the horizon this batch covers
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The state to checkpoint: ``{"value": β}`` (target and horizon come from config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore β from :meth:`state_dict` output."""
        self.value = _value_from_state(state)


def _value_from_state(state: dict[str, float]) -> float:
    if "value" not in state:
        raise ValueError(f"KL controller state needs a 'value' key, got keys {sorted(state)}")
    return float(state["value"])


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    *,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL(π_θ ‖ π_ref) as a loss term (GRPO's anchor, instead of KL in the reward).

    Args:
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        ref_log_probs: Log-probs under the reference policy. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        kind: A :func:`kl_penalty` kind; "low_var_kl" (k3) is the usual choice, and
            "low_var_kl+" keeps its value but trains with k2's gradient, the unbiased
            gradient of KL(π_θ ‖ π_ref) (k3's own gradient is that of KL(π_ref ‖ π_θ)).
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``; ``loss`` Shape: (), in nats (the caller multiplies by its
        coefficient). ``metrics``: ``"kl_loss"`` (detached, 0-dim).

    Raises:
        ValueError: On bad shapes, an unknown kind or mode, or an empty mask.
    """
    check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs, response_mask=response_mask)
    # per-token KL estimate, aggregated like the policy loss it is added to
    loss = aggregate_loss(kl_penalty(log_probs, ref_log_probs, kind), response_mask, loss_agg_mode)
    return loss, {"kl_loss": loss.detach()}
