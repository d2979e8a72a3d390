"""PPO math for language models, as pure functions.

Everything the trainer and the actor/critic services compute *about* a batch lives
here: masked statistics, KL estimators and the KL-in-reward penalty, KL-coefficient
controllers, advantage estimators (GAE, GRPO, RLOO, REINFORCE++, OPO, GPG, GRPO pass@k,
GDPO, ReMax, optimal token baseline), entropy, loss aggregation and its mini-batch
normalisation, the policy losses (PPO clip, GSPO, CISPO, GMPO, Clip-Cov, KL-Cov,
REINFORCE, SAPO, DPPO), truncated importance weights against the rollout engine's
log-probs and the clipped value loss.

The run config chooses advantage estimators, policy losses, KL estimators and loss
aggregation modes by name from the registries below; each name has an
:class:`AlgorithmNote` (one line and its paper), which ``rlserve config --describe``
prints under the field that selects it.

Notation::

    B            batch of sequences (one prompt + one sampled response per row)
    T            padded response length
    V            vocabulary size
    G            number of prompt groups (samples of the same prompt share a group id)
    response_mask  (B, T), 1 for response tokens, 0 elsewhere; bool, int or float.
                   May hold left padding, right padding or gaps (e.g. tool output
                   inside a multi-turn response).
    logprob      (B, T) log π_θ(token | prefix) in nats, current policy (with grad)
    old_logprob  (B, T) the same under the policy that generated the batch
    ref_logprob  (B, T) the same under the frozen reference policy
    score        (B,) one outcome reward per sequence (from the reward service)

Design choices:

- Inputs are tensors and floats; outputs are tensors plus, where useful, a metrics
  dict of detached 0-dim tensors. No ``.item()``, no logging, no distributed calls:
  the caller decides when to sync and what to reduce across ranks.
- Entries outside the mask may hold anything (padding garbage, even inf/nan); every
  function selects with ``torch.where`` so they never reach a result, and every
  (B, T) output is exactly 0 outside the mask.
- A check that needs the data (an all-empty mask) is a host sync; it is done only
  where the result would otherwise be undefined (a mean or variance over nothing).
- Advantage estimators run under ``torch.no_grad()``: advantages and returns are
  targets, never differentiated through.
- Deviations from VeRL, on purpose: by default a prompt group of size 1 gets
  advantage 0 in the group estimators (one sample carries no relative signal; VeRL
  passes its raw score through, ``singleton_groups="score"`` does the same);
  REINFORCE++ skips mask gaps the way GAE does, here and in VeRL (VeRL's REINFORCE++
  instead zeroes its running return at every token outside the mask, so the tokens
  before a gap get none of the rewards after it, the final score included);
  "seq-mean-token-sum-norm" averages over sequences where VeRL sums (see
  :func:`aggregate_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_ESTIMATOR_NOTES",
    "DEFAULT_CLIP_RATIOS",
    "KL_KINDS",
    "KL_KIND_NOTES",
    "LOSS_AGG_MODES",
    "LOSS_AGG_MODE_NOTES",
    "POLICY_LOSSES",
    "POLICY_LOSS_NOTES",
    "SINGLETON_GROUP_CHOICES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AlgorithmNote",
    "EstimatorInputs",
    "FixedKLController",
    "PolicyLoss",
    "aggregate_loss",
    "cispo_loss",
    "clip_cov_loss",
    "compute_gae_advantages_returns",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "entropy_from_logits",
    "estimator_needs",
    "gdpo_advantages",
    "get_advantage_estimator",
    "get_policy_loss",
    "gmpo_loss",
    "gpg_advantages",
    "grpo_advantages",
    "grpo_passk_advantages",
    "gspo_loss",
    "kl_cov_loss",
    "kl_loss",
    "kl_metrics",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mini_batch_loss_scale",
    "needs_critic",
    "needs_group_ids",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "policy_loss",
    "reinforce_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "resolve_clip_ratios",
    "rloo_advantages",
    "sapo_loss",
    "token_rewards_with_kl_penalty",
    "truncated_is_weights",
    "value_loss",
]

# Log-ratios are clamped to ±20 nats before exp(): e^20 ≈ 5e8 still fits fp16/bf16
# ranges after multiplication by small advantages, and a real policy step never moves
# a token's log-prob that far, so the clamp only guards against overflow.
_LOG_RATIO_CLAMP = 20.0
# VeRL's bound for the k3 estimate: it is non-negative but unbounded, and a handful of
# tokens with a huge ratio would otherwise dominate the batch KL.
_K3_CLAMP = 10.0


@dataclass(frozen=True)
class AlgorithmNote:
    """What a registered name does, in one line, and the paper it comes from.

    Every registry here (advantage estimators, policy losses, KL estimators, loss
    aggregation modes) keeps one note per name; the run config shows them under the
    field that selects them (``rlserve config --describe``), so the descriptions live
    in one place and a test checks that every registered name has one.
    """

    summary: str
    """One line: what it computes."""
    paper: str
    """Authors, year, title and arXiv id (or where the idea comes from)."""

    def line(self) -> str:
        """``summary — paper``, the form ``rlserve config --describe`` prints."""
        return f"{self.summary} — {self.paper}"


# --------------------------------------------------------------------------- checks


def _check_same_shape(**tensors: Tensor) -> None:
    """Raise ValueError unless all named tensors have the same shape."""
    (first_name, first), *rest = tensors.items()
    for name, tensor in rest:
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {first_name} has shape "
                f"{tuple(first.shape)}; they must be equal"
            )


def _check_2d(name: str, tensor: Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must have shape (B, T), got {tuple(tensor.shape)}")


def _check_groups(scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> None:
    """Validate the (B,) / (B,) / (B, T) inputs of the outcome estimators."""
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape (B,), got {tuple(scores.shape)}")
    _check_same_shape(scores=scores, group_ids=group_ids)
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    _check_2d("response_mask", response_mask)
    if response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"response_mask has {response_mask.shape[0]} rows but scores has "
            f"{scores.shape[0]} entries; they must be equal"
        )


def _check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


# ----------------------------------------------------------------- masked statistics


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is 1.

    Args:
        values: Any shape.
        mask: Same shape as ``values``; 0/1 (bool, int or float).
        dim: Dimension to reduce; ``None`` reduces everything to a 0-dim tensor.

    Returns:
        The masked sum. Shape: ``values.shape`` without ``dim`` (0-dim if ``None``).

    Raises:
        ValueError: If shapes differ.
    """
    _check_same_shape(values=values, mask=mask)
    # where() rather than multiply: 0 * inf would be nan for garbage outside the mask
    selected = torch.where(mask.bool(), values, torch.zeros_like(values))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the entries where ``mask`` is 1.

    Args:
        values: Any shape.
        mask: Same shape as ``values``; 0/1 (bool, int or float).
        dim: Dimension to reduce; ``None`` reduces everything to a 0-dim tensor.

    Returns:
        The masked mean. Shape: ``values.shape`` without ``dim`` (0-dim if ``None``).
        With ``dim`` given, a slice with no valid entry has mean 0 (e.g. a padding row).

    Raises:
        ValueError: If shapes differ, or ``dim`` is ``None`` and the mask is all zero.
    """
    total = masked_sum(values, mask, dim)
    if dim is None:
        count = mask.bool().sum()
        if not bool(count > 0):
            raise ValueError("masked_mean: the mask is all zero, the mean is undefined")
        # plain mean over the valid entries
        return total / count
    count = mask.bool().sum(dim=dim)
    # clamp the count so empty slices give 0 / 1 = 0 instead of nan
    return total / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over all entries where ``mask`` is 1.

    Args:
        values: Any shape.
        mask: Same shape as ``values``; 0/1 (bool, int or float).
        unbiased: Apply Bessel's correction (divide by n - 1 instead of n).

    Returns:
        The masked variance. Shape: () (0-dim).

    Raises:
        ValueError: If shapes differ, or fewer than 2 (unbiased) / 1 valid entries.
    """
    _check_same_shape(values=values, mask=mask)
    count = mask.bool().sum()
    needed = 2 if unbiased else 1
    if not bool(count >= needed):
        raise ValueError(
            f"masked_var: needs at least {needed} valid entries "
            f"({'unbiased' if unbiased else 'biased'}), the mask has {int(count)}"
        )
    mean = masked_mean(values, mask)
    # squared deviations from the masked mean, summed over valid entries only
    sum_sq = masked_sum((values - mean) ** 2, mask)
    # Bessel's correction: n - 1 degrees of freedom remain after estimating the mean
    return sum_sq / (count - 1 if unbiased else count)


def masked_whiten(
    values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Normalise ``values`` to unit variance (and zero mean) over the mask.

    Args:
        values: Any shape.
        mask: Same shape as ``values``; 0/1 (bool, int or float).
        shift_mean: If False, the masked mean is added back (only the scale changes).
        eps: Added to the variance before the square root.

    Returns:
        Whitened values, 0 outside the mask. Shape: ``values.shape``.

    Raises:
        ValueError: If shapes differ or the mask has fewer than 2 valid entries.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    # (x - μ) / σ over the valid entries
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        # keep the original mean, rescale only (used when the sign of the mean matters)
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


# ---------------------------------------------------------------------------- KL

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


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from sampled tokens' log-probs.

    Tokens are sampled from π, so with log_ratio = logprob - ref_logprob
    (Schulman, "Approximating KL divergence", 2020):

    - ``"k1"`` / ``"kl"``: log_ratio. Unbiased, high variance, can be negative.
    - ``"k2"`` / ``"mse"``: 0.5 * log_ratio². Biased, low variance, >= 0.
    - ``"k3"`` / ``"low_var_kl"``: exp(-log_ratio) + log_ratio - 1. Unbiased, >= 0,
      low variance; clamped to [-10, 10] like VeRL.
    - ``"abs"``: |log_ratio|.
    - ``"k1+"``, ``"k3+"``, ``"low_var_kl+"``: straight-through. The value is the named
      estimator's, the gradient is k2's, ``log_ratio · ∇logprob``, whose expectation
      under π is the exact gradient of KL(π ‖ π_ref) (k1's gradient has expectation 0,
      k3's is the gradient of the other direction, KL(π_ref ‖ π)). Only matters in a
      loss (:func:`kl_loss`); in the reward the value alone counts.

    Args:
        logprob: Log-probs under the current (or old) policy, nats. Shape: (B, T).
        ref_logprob: Log-probs under the reference policy, nats. Shape: (B, T).
        kind: One of :data:`KL_KINDS`.

    Returns:
        Per-token KL estimate in nats (not masked). Shape: (B, T).

    Raises:
        ValueError: On a shape mismatch or an unknown ``kind``.
    """
    _check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    log_ratio = logprob - ref_logprob
    if kind.endswith("+") and kind in KL_KINDS:
        value = kl_penalty(logprob, ref_logprob, kind.removesuffix("+"))
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
        log_r = torch.clamp(-log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
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
    _check_2d("token_kl", token_kl)
    _check_same_shape(token_kl=token_kl, response_mask=response_mask)
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


def overlong_penalty(
    response_lengths: Tensor, max_response_tokens: int, buffer_tokens: int, factor: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment, added to each sequence's score.

    Yu et al. 2025, "DAPO", arXiv:2503.14476, eq. 13: with L_max the longest response
    and a buffer of L_cache tokens before it, a response of L tokens gets 0 while
    L <= L_max - L_cache, then a penalty growing linearly to -factor at L = L_max, and
    -factor beyond (generation caps responses at L_max, so only a caller with longer
    ones sees that case). The penalty tells the policy that length itself costs,
    before truncation cuts an answer off.

    Args:
        response_lengths: Response tokens per sequence. Shape: (B,).
        max_response_tokens: L_max (>= 1).
        buffer_tokens: L_cache, in 1..L_max.
        factor: Penalty at L_max (>= 0).

    Returns:
        The penalty, <= 0. Shape: (B,), float32.

    Raises:
        ValueError: On a bad shape or setting.
    """
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths must be (B,), got {tuple(response_lengths.shape)}")
    if max_response_tokens < 1:
        raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
    if not 1 <= buffer_tokens <= max_response_tokens:
        raise ValueError(
            f"buffer_tokens must be in 1..{max_response_tokens} (max_response_tokens), "
            f"got {buffer_tokens}"
        )
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    lengths = response_lengths.float()
    expected = max_response_tokens - buffer_tokens
    # linear in the buffer: 0 at its start, -factor at L_max; -factor beyond it
    penalty = (expected - lengths) / buffer_tokens * factor
    return penalty.clamp(min=-factor, max=0.0)


def truncated_responses(
    responses: Tensor, response_mask: Tensor, eos_token_id: int, max_response_tokens: int
) -> Tensor:
    """Which responses generation cut off: L_max tokens long without ending in EOS.

    DAPO (arXiv:2503.14476, "overlong filtering") leaves such samples out of the loss:
    a reasoning cut short is not wrong, and scoring it as wrong teaches noise.

    Args:
        responses: Response token ids, right-padded. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        eos_token_id: The tokenizer's end-of-sequence id.
        max_response_tokens: The generation cap L_max.

    Returns:
        True for a truncated response. Shape: (B,), bool.
    """
    _check_2d("responses", responses)
    _check_same_shape(responses=responses, response_mask=response_mask)
    mask = response_mask.bool()
    lengths = mask.sum(dim=1)
    positions = torch.arange(responses.shape[1], device=mask.device).expand_as(mask)
    last_index = torch.where(mask, positions, torch.zeros_like(positions)).amax(dim=1)
    last_token = responses.gather(1, last_index[:, None]).squeeze(1)
    return (lengths >= max_response_tokens) & (last_token != eos_token_id)


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


# -------------------------------------------------------------------- advantages


@torch.no_grad()
def compute_gae_advantages_returns(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    whiten_advantages: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over response tokens.

    Only tokens inside the mask are steps of the episode: a token outside it neither
    adds reward nor is bootstrapped through, so "the next value" of a token is the
    value of the next *valid* token (0 after the last one: the episode ends there).
    Gaps and padding on either side are therefore handled exactly.

    Args:
        token_rewards: Reward per token. Shape: (B, T).
        values: Critic value per token (V(s_t) before token t is emitted). Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        gamma: Discount per valid token, in [0, 1].
        lam: GAE λ, in [0, 1] (0 = one-step TD, 1 = Monte Carlo).
        whiten_advantages: Whiten advantages over the mask (the returns are not).

    Returns:
        ``(advantages, returns)``, both Shape: (B, T) and 0 outside the mask;
        ``returns = advantages (before whitening) + values`` (the critic's target).

    Raises:
        ValueError: On bad shapes or gamma/lam outside [0, 1].
    """
    _check_2d("token_rewards", token_rewards)
    _check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    _check_unit_interval("gamma", gamma)
    _check_unit_interval("lam", lam)
    mask = response_mask.bool()
    batch_size, num_tokens = token_rewards.shape
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    next_value = torch.zeros(batch_size, dtype=dtype, device=values.device)
    last_gae = torch.zeros(batch_size, dtype=dtype, device=values.device)
    advantages = torch.zeros(batch_size, num_tokens, dtype=dtype, device=values.device)
    for t in reversed(range(num_tokens)):
        valid = mask[:, t]
        # TD error: reward + discounted value of the next valid token - this value
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        # GAE recursion A_t = δ_t + γλ·A_{t+1}, A_{t+1} being the next valid token's
        gae = delta + gamma * lam * last_gae
        # invalid tokens leave the running state untouched: gaps are skipped over
        last_gae = torch.where(valid, gae, last_gae)
        next_value = torch.where(valid, values[:, t].to(dtype), next_value)
        advantages[:, t] = torch.where(valid, gae, torch.zeros_like(gae))
    # the critic's regression target: A + V = λ-return
    returns = torch.where(mask, advantages + values, torch.zeros_like(advantages))
    if whiten_advantages:
        # batch-level normalisation keeps the policy step size independent of reward scale
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer ids to 0..G-1. Returns (index (B,), G)."""
    unique_ids, index = torch.unique(group_ids, return_inverse=True)
    return index, unique_ids.numel()


def _group_sum(values: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """Sum ``values`` (B,) per group, broadcast back to each sample. Shape: (B,)."""
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return sums.index_add(0, index, values)[index]


def _group_reduce(values: Tensor, index: Tensor, num_groups: int, reduce: str) -> Tensor:
    """ "amax" or "amin" of ``values`` (B,) per group, broadcast back. Shape: (B,)."""
    empty = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return empty.scatter_reduce(0, index, values, reduce=reduce, include_self=False)[index]


def _group_std(centred: Tensor, index: Tensor, num_groups: int, count: Tensor) -> Tensor:
    """Unbiased std per group from the deviations from the group mean, broadcast back;
    n - 1 is clamped so a singleton does not divide by 0. Shape: (B,)."""
    return torch.sqrt(_group_sum(centred.square(), index, num_groups) / (count - 1).clamp(min=1))


def _outcome_scores(scores: Tensor) -> Tensor:
    """Scores as floating point (ints and bools become float32)."""
    return scores if scores.is_floating_point() else scores.float()


def _broadcast_over_mask(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """Spread one value per sequence over its response tokens. (B,) -> (B, T)."""
    expanded = per_sequence[:, None].expand(response_mask.shape)
    return torch.where(response_mask.bool(), expanded, torch.zeros_like(expanded))


SINGLETON_GROUP_CHOICES: tuple[str, ...] = ("zero", "score")
"""What a prompt group of one sample gets from the group estimators: ``"zero"``
(advantage 0: one sample has nothing to be compared with; rlserve's default) or
``"score"`` (baseline 0, so its raw score passes through, as VeRL does)."""


def _singleton_advantage(scores: Tensor, singleton_groups: str) -> Tensor:
    """The (B,) advantage each sample would get if it were alone in its group."""
    if singleton_groups == "zero":
        return torch.zeros_like(scores)
    if singleton_groups == "score":
        return scores
    raise ValueError(
        f"unknown singleton_groups {singleton_groups!r}; valid choices: "
        f"{', '.join(SINGLETON_GROUP_CHOICES)}"
    )


@torch.no_grad()
def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
    singleton_groups: str = "zero",
) -> Tensor:
    """GRPO outcome advantages (Shao et al., 2024, arXiv:2402.03300).

    ``A_i = (s_i - mean_g) / (std_g + eps)`` with the unbiased std of the group, or
    ``s_i - mean_g`` when ``normalize_by_std`` is False (Dr. GRPO, Liu et al., 2025,
    arXiv:2503.20783: the std divisor up-weights prompts that are too easy or too hard).

    Args:
        scores: Outcome reward per sequence. Shape: (B,).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        response_mask: 1 for response tokens. Shape: (B, T).
        normalize_by_std: Divide by the group's standard deviation.
        eps: Added to the std (a group with equal scores then gets 0, not nan).
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        The sequence advantage on each of its response tokens. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    _check_groups(scores, group_ids, response_mask)
    scores = _outcome_scores(scores)
    index, num_groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, num_groups)
    # group mean: the baseline shared by all samples of one prompt
    mean = _group_sum(scores, index, num_groups) / count
    centred = scores - mean
    if normalize_by_std:
        # scale-free advantage: how many group stds above the group mean
        centred = centred / (_group_std(centred, index, num_groups, count) + eps)
    # one sample has nothing to be compared with
    advantages = torch.where(count > 1, centred, _singleton_advantage(scores, singleton_groups))
    return _broadcast_over_mask(advantages, response_mask)


@torch.no_grad()
def rloo_advantages(
    scores: Tensor, group_ids: Tensor, response_mask: Tensor, singleton_groups: str = "zero"
) -> Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al., 2024, arXiv:2402.14740).

    ``A_i = s_i - mean of the other samples in i's group``.

    Args:
        scores: Outcome reward per sequence. Shape: (B,).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        response_mask: 1 for response tokens. Shape: (B, T).
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        The sequence advantage on each of its response tokens. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    _check_groups(scores, group_ids, response_mask)
    scores = _outcome_scores(scores)
    index, num_groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, num_groups)
    total = _group_sum(scores, index, num_groups)
    # baseline = mean of the n - 1 other samples (independent of s_i, so unbiased)
    baseline = (total - scores) / (count - 1).clamp(min=1)
    # a singleton has no other sample to form a baseline
    advantages = torch.where(
        count > 1, scores - baseline, _singleton_advantage(scores, singleton_groups)
    )
    return _broadcast_over_mask(advantages, response_mask)


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    scores: Tensor, group_ids: Tensor, response_mask: Tensor, singleton_groups: str = "zero"
) -> Tensor:
    """REINFORCE++ with a group-mean baseline (Hu, 2025, arXiv:2501.03262; VeRL's
    "reinforce_plus_plus_baseline").

    The group mean is subtracted from each score, the result is spread over the
    response tokens and whitened over all response tokens of the batch (so longer
    responses weigh more in the statistics).

    Args:
        scores: Outcome reward per sequence. Shape: (B,).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        response_mask: 1 for response tokens. Shape: (B, T).
        singleton_groups: What a group of size 1 gets before whitening; see
            :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        Whitened advantages, 0 outside the mask. Shape: (B, T).

    Raises:
        ValueError: On bad shapes, non-integer ``group_ids`` or < 2 response tokens.
    """
    _check_groups(scores, group_ids, response_mask)
    scores = _outcome_scores(scores)
    index, num_groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, num_groups)
    # subtract the prompt's mean score: removes prompt difficulty from the signal
    centred = scores - _group_sum(scores, index, num_groups) / count
    centred = torch.where(count > 1, centred, _singleton_advantage(scores, singleton_groups))
    # batch-wide whitening over tokens, as in REINFORCE++ (Hu, 2025)
    return masked_whiten(_broadcast_over_mask(centred, response_mask), response_mask)


@torch.no_grad()
def opo_advantages(
    scores: Tensor, group_ids: Tensor, response_mask: Tensor, singleton_groups: str = "zero"
) -> Tensor:
    """OPO advantages (Hao et al., 2025, "On-Policy RL with Optimal Reward Baseline",
    arXiv:2505.23585): score minus the length-weighted mean score of its group.

    ``b_g = Σ_j |y_j|·s_j / Σ_j |y_j|`` over the group's samples, ``A_i = s_i - b_g``,
    with |y_j| the number of response tokens of sample j. For sequence-level rewards
    this is the baseline that minimises the gradient variance when a sequence's
    gradient norm grows with its length (the paper's derivation). A group whose
    samples have no response token at all gets baseline 0 (its rows carry no token).

    Args:
        scores: Outcome reward per sequence. Shape: (B,).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        response_mask: 1 for response tokens. Shape: (B, T).
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        The sequence advantage on each of its response tokens. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    _check_groups(scores, group_ids, response_mask)
    scores = _outcome_scores(scores)
    index, num_groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, num_groups)
    lengths = response_mask.bool().sum(dim=1).to(scores.dtype)
    # Σ|y|·s and Σ|y| per group
    weighted = _group_sum(lengths * scores, index, num_groups)
    total_length = _group_sum(lengths, index, num_groups)
    # length-weighted mean score; a group without tokens has nothing to weigh
    baseline = torch.where(
        total_length > 0, weighted / total_length.clamp(min=1), torch.zeros_like(weighted)
    )
    advantages = torch.where(
        count > 1, scores - baseline, _singleton_advantage(scores, singleton_groups)
    )
    return _broadcast_over_mask(advantages, response_mask)


@torch.no_grad()
def gpg_advantages(
    scores: Tensor, group_ids: Tensor, response_mask: Tensor, singleton_groups: str = "zero"
) -> Tensor:
    """GPG advantages (Chu et al., 2025, "GPG: A Simple and Strong Reinforcement
    Learning Baseline for Model Reasoning", arXiv:2504.02546).

    ``A_i = α·(s_i - mean_g)`` with ``α = B / (B - M)``: B samples in the batch, M of
    them in groups whose scores are all equal (their advantage is 0 and they add
    nothing to the gradient, but the batch mean still divides by them; α scales the
    rest back up, the paper's "accurate gradient estimation"). This is the paper's
    best setting, F_norm = 1 (no std division); its threshold β_th, which resamples a
    batch with too few valid samples, is a sampling rule and not done here. Pair with
    the "reinforce" policy loss (plain policy gradient, as in the paper).

    A group of size 1 counts among the M under ``singleton_groups="zero"``; under
    ``"score"`` it keeps its raw score (then scaled by α) and is not counted.

    Args:
        scores: Outcome reward per sequence. Shape: (B,).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        response_mask: 1 for response tokens. Shape: (B, T).
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        The sequence advantage on each of its response tokens. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    _check_groups(scores, group_ids, response_mask)
    scores = _outcome_scores(scores)
    index, num_groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, num_groups)
    centred = scores - _group_sum(scores, index, num_groups) / count
    # a group is degenerate when all its scores are equal (max == min, exact in floats)
    group_max = _group_reduce(scores, index, num_groups, "amax")
    degenerate = group_max == _group_reduce(scores, index, num_groups, "amin")
    singleton = _singleton_advantage(scores, singleton_groups)
    kept_singleton = (count == 1) & (singleton_groups == "score")
    # zero by construction (no float residue from the mean of equal values)
    advantages = torch.where(degenerate, torch.zeros_like(centred), centred)
    advantages = torch.where(count > 1, advantages, singleton)
    # M: samples whose advantage is 0 because their group gives no relative signal
    invalid = (degenerate & ~kept_singleton).sum()
    batch = scores.numel()
    # α = B / (B - M): the batch mean over B becomes a mean over the valid samples
    alpha = batch / (batch - invalid).clamp(min=1).to(scores.dtype)
    return _broadcast_over_mask(alpha * advantages, response_mask)


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: Tensor, response_mask: Tensor, gamma: float
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu, 2025): discounted returns-to-go, whitened over the batch.

    ``G_t = r_t + γ·G_{t'}`` where t' is the next valid token; tokens outside the mask
    are skipped (their reward is ignored, and they do not discount).

    Args:
        token_rewards: Reward per token (score and KL penalty). Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        gamma: Discount per valid token, in [0, 1].

    Returns:
        ``(advantages, returns)``, both Shape: (B, T), 0 outside the mask;
        advantages are the whitened returns.

    Raises:
        ValueError: On bad shapes, gamma outside [0, 1] or < 2 response tokens.
    """
    _check_2d("token_rewards", token_rewards)
    _check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    _check_unit_interval("gamma", gamma)
    mask = response_mask.bool()
    batch_size, num_tokens = token_rewards.shape
    running = torch.zeros(batch_size, dtype=token_rewards.dtype, device=token_rewards.device)
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(num_tokens)):
        valid = mask[:, t]
        # return-to-go: this reward plus the discounted return of the next valid token
        running = torch.where(valid, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, torch.zeros_like(running))
    # whitening across the batch is REINFORCE++'s substitute for a critic baseline
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def grpo_passk_advantages(
    scores: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
    singleton_groups: str = "zero",
) -> Tensor:
    """GRPO for pass@k (Tang et al., 2025, "Optimizing Language Models for Inference
    Time Objectives using Reinforcement Learning", arXiv:2503.19595; VeRL's "grpo_passk").

    A group of k samples counts as solved when its best sample is: only that sample
    gets a signal, ``A_best = (s_max - s_second) / (std_g + eps)`` (without the std
    when ``normalize_by_std`` is False); the others get 0. With tied best scores the
    earliest row is the best one, and its advantage is 0.

    Args:
        scores: Outcome reward per sequence. Shape: (B,).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        response_mask: 1 for response tokens. Shape: (B, T).
        normalize_by_std: Divide by the group's (unbiased) standard deviation.
        eps: Added to the std.
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        The sequence advantage on each of its response tokens. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    _check_groups(scores, group_ids, response_mask)
    scores = _outcome_scores(scores)
    index, num_groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, num_groups)
    group_max = _group_reduce(scores, index, num_groups, "amax")
    # the best sample: the first row (lowest position) holding its group's maximum
    position = torch.arange(scores.numel(), device=scores.device)
    candidate = torch.where(
        scores == group_max, position, torch.full_like(position, scores.numel())
    )
    best = position == _group_reduce(candidate, index, num_groups, "amin")
    # the runner-up: the largest score among the group's other rows
    others = torch.where(best, torch.full_like(scores, -math.inf), scores)
    gap = group_max - _group_reduce(others, index, num_groups, "amax")
    if normalize_by_std:
        centred = scores - _group_sum(scores, index, num_groups) / count
        gap = gap / (_group_std(centred, index, num_groups, count) + eps)
    advantages = torch.where(best, gap, torch.zeros_like(gap))
    advantages = torch.where(count > 1, advantages, _singleton_advantage(scores, singleton_groups))
    return _broadcast_over_mask(advantages, response_mask)


@torch.no_grad()
def gdpo_advantages(
    component_scores: Tensor,
    component_weights: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    eps: float = 1e-6,
    singleton_groups: str = "zero",
) -> Tensor:
    """GDPO: normalise each reward component within its group, then combine (Liu et
    al., 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization", arXiv:2601.05242).

    Summing K rewards before GRPO's normalisation lets distinct combinations collapse to
    one advantage (e.g. (1, 0) and (0, 1) in a group); GDPO keeps them apart::

        A_k = GRPO advantage of component k within its group   (mean/std per group)
        A   = whiten(Σ_k w_k·A_k)                              (over the batch's tokens)

    Args:
        component_scores: One column per reward component (the reward service's
            ``scores_<kind>``). Shape: (B, K).
        component_weights: Weight of each component. Shape: (K,).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        response_mask: 1 for response tokens. Shape: (B, T).
        eps: Added to each group std.
        singleton_groups: What a group of size 1 gets per component before the
            combination; see :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        Whitened advantages, 0 outside the mask. Shape: (B, T).

    Raises:
        ValueError: On bad shapes, non-integer ``group_ids`` or < 2 response tokens.
    """
    _check_2d("component_scores", component_scores)
    if component_weights.shape != (component_scores.shape[1],):
        raise ValueError(
            f"component_weights must have shape ({component_scores.shape[1]},), one per "
            f"column of component_scores; got {tuple(component_weights.shape)}"
        )
    components = _outcome_scores(component_scores)
    combined = torch.zeros_like(response_mask, dtype=components.dtype)
    for k in range(components.shape[1]):
        combined = combined + component_weights[k].to(components.dtype) * grpo_advantages(
            components[:, k],
            group_ids,
            response_mask,
            eps=eps,
            singleton_groups=singleton_groups,
        )
    # batch-level whitening: the combined advantage's scale no longer grows with K
    return masked_whiten(combined, response_mask)


def _returns_to_go(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Undiscounted sum of the token rewards from each response token on (tokens
    outside the mask are skipped). Shape: (B, T), 0 outside the mask."""
    mask = response_mask.bool()
    rewards = torch.where(mask, token_rewards, torch.zeros_like(token_rewards))
    returns = rewards.flip(dims=[1]).cumsum(dim=1).flip(dims=[1])
    return torch.where(mask, returns, torch.zeros_like(returns))


@torch.no_grad()
def remax_advantages(
    token_rewards: Tensor, baseline_scores: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax: REINFORCE with the greedy response's reward as the baseline (Li et al.,
    2024, "ReMax: A Simple, Effective, and Efficient RL Method for Aligning LLMs",
    arXiv:2310.10505).

    ``A_t = G_t - b``: the return-to-go of the token rewards (score and KL penalty) minus
    the score of the greedy (temperature 0) response to the same prompt. The baseline
    needs no critic and no second sample; its cost is one greedy generation and one
    reward call per prompt.

    Args:
        token_rewards: Reward per token (score and KL penalty). Shape: (B, T).
        baseline_scores: Score of the greedy response to each row's prompt. Shape: (B,).
        response_mask: 1 for response tokens. Shape: (B, T).

    Returns:
        ``(advantages, returns)``, both Shape: (B, T), 0 outside the mask.

    Raises:
        ValueError: On bad shapes.
    """
    _check_2d("token_rewards", token_rewards)
    _check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    if baseline_scores.shape != (token_rewards.shape[0],):
        raise ValueError(
            f"baseline_scores must have shape ({token_rewards.shape[0]},), one per row; "
            f"got {tuple(baseline_scores.shape)}"
        )
    returns = _returns_to_go(token_rewards, response_mask)
    baseline = _broadcast_over_mask(baseline_scores.to(returns.dtype), response_mask)
    return returns - baseline, returns


@torch.no_grad()
def optimal_token_baseline_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    old_logprob: Tensor,
    sum_pi_squared: Tensor,
    token_weights: Tensor | None = None,
    singleton_groups: str = "zero",
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Optimal token baseline: one baseline per prompt group and position, weighted by
    each path's accumulated gradient variance (VeRL's "optimal_token_baseline", after
    the variance-minimising baseline of Greensmith et al., 2004, "Variance Reduction
    Techniques for Gradient Estimates in RL", JMLR 5).

    The baseline that minimises a score-function estimator's variance weighs each
    sample by its squared gradient norm. For a softmax policy the squared norm of
    ∇_logits log π(y_t) is ``1 - 2π(y_t) + Σ_v π(v)²``; summed along a response it is
    the path's variance proxy ``W_t = Σ_{j<=t} (1 - 2π_j + Σπ²_j)``. With the return-to-go
    ``G_t`` (undiscounted), at every position t of group g::

        B_{g,t} = Σ_i G_{i,t}·W_{i,t} / Σ_i W_{i,t}     (over the group's responses
                                                         that reach position t)
        A_{i,t} = G_{i,t} - B_{g,t}

    ``token_weights`` (rollout correction, :func:`truncated_is_weights`) scale each
    token's variance term by ``w²``, as an importance-weighted gradient's variance does.
    A group of one sample has no baseline: its advantage is 0 (``singleton_groups=
    "zero"``) or its return (``"score"``, VeRL's choice).

    Args:
        token_rewards: Reward per token (score and KL penalty). Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        old_logprob: log π_old of the sampled tokens. Shape: (B, T).
        sum_pi_squared: Σ_v π_old(v)² at each position. Shape: (B, T).
        token_weights: Importance weights of the tokens, or None. Shape: (B, T).
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.
        eps: Added to the weight sum.

    Returns:
        ``(advantages, returns)``, both Shape: (B, T), 0 outside the mask.

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    _check_2d("token_rewards", token_rewards)
    _check_same_shape(
        token_rewards=token_rewards,
        response_mask=response_mask,
        old_logprob=old_logprob,
        sum_pi_squared=sum_pi_squared,
    )
    # one entry per row, as the group estimators check their scores
    _check_groups(token_rewards[:, 0], group_ids, response_mask)
    mask = response_mask.bool()
    old_logprob, sum_pi_squared = _inside_mask(mask, old_logprob, sum_pi_squared)
    returns = _returns_to_go(token_rewards, mask)
    variance = 1 - 2 * torch.exp(old_logprob) + sum_pi_squared
    if token_weights is not None:
        _check_same_shape(token_weights=token_weights, response_mask=response_mask)
        variance = variance * torch.where(mask, token_weights, torch.zeros_like(token_weights)) ** 2
    path_variance = torch.where(mask, variance, torch.zeros_like(variance)).cumsum(dim=1)
    path_variance = torch.where(mask, path_variance, torch.zeros_like(path_variance))
    index, num_groups = _group_index(group_ids)
    # per group and position: Σ_i G·W and Σ_i W (rows outside the mask add 0)
    width = returns.shape[1]
    sums = torch.zeros(num_groups, width, dtype=returns.dtype, device=returns.device)
    weighted = sums.index_add(0, index, returns * path_variance)[index]
    total = sums.index_add(0, index, path_variance)[index]
    baseline = weighted / (total + eps)
    advantages = torch.where(mask, returns - baseline, torch.zeros_like(returns))
    count = _group_sum(torch.ones_like(returns[:, 0]), index, num_groups)
    # a group of one has no baseline: advantage 0, or (under "score") its own return
    keeps_return = _singleton_advantage(torch.ones_like(count), singleton_groups)
    advantages = torch.where((count == 1)[:, None], keeps_return[:, None] * returns, advantages)
    return advantages, returns


@torch.no_grad()
def truncated_is_weights(
    old_logprob: Tensor, rollout_logprob: Tensor, response_mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights from the rollout engine's policy to the trainer's
    (Yao et al., 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training", fengyao.notion.site/off-policy-rl; VeRL's token-level "rollout_is").

    The engine that sampled a response (vLLM, or hf generation in another dtype or
    batch layout) computes slightly different probabilities than the trainer's forward:
    the samples come from π_rollout, not π_old. Each token's policy-gradient term is
    weighted by ``w_t = min(π_old(y_t)/π_rollout(y_t), cap)``; the cap bounds the
    variance a rare token could add.

    Args:
        old_logprob: Log-probs under the trainer's policy at generation time. Shape: (B, T).
        rollout_logprob: Log-probs the rollout engine reported for the same tokens.
            Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        cap: Largest weight (> 0; VeRL's examples use 2).

    Returns:
        ``(weights, metrics)``: weights Shape: (B, T), 0 outside the mask; metrics
        (0-dim): ``"is_weight_mean"`` (before the cap), ``"capped_fraction"`` (tokens at
        the cap), ``"mismatch_kl"`` (mean of log π_rollout - log π_old over tokens: a
        k1 estimate of KL(π_rollout ‖ π_old) on the engine's own samples).

    Raises:
        ValueError: On bad shapes, a cap <= 0 or an empty mask.
    """
    _check_2d("old_logprob", old_logprob)
    _check_same_shape(
        old_logprob=old_logprob, rollout_logprob=rollout_logprob, response_mask=response_mask
    )
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    mask = response_mask.bool()
    old_logprob, rollout_logprob = _inside_mask(mask, old_logprob, rollout_logprob)
    log_ratio = _clamped_log_ratio(old_logprob, rollout_logprob)
    ratio = torch.exp(log_ratio)
    weights = torch.where(mask, torch.clamp(ratio, max=cap), torch.zeros_like(ratio))
    metrics = {
        "is_weight_mean": masked_mean(ratio, mask),
        "capped_fraction": masked_mean((ratio > cap).to(ratio.dtype), mask),
        "mismatch_kl": masked_mean(-log_ratio, mask),
    }
    return weights, metrics


@dataclass(frozen=True)
class EstimatorInputs:
    """What an advantage estimator may read besides the token rewards and the response
    mask, and its knobs. Each estimator takes what it needs (ValueError naming a missing
    tensor) and ignores the rest; :func:`estimator_needs` says which a name needs."""

    values: Tensor | None = None
    """Critic values ("gae"). Shape: (B, T)."""
    group_ids: Tensor | None = None
    """Prompt group of each row (the group estimators). Shape: (B,)."""
    baseline_scores: Tensor | None = None
    """Score of the greedy response to each row's prompt ("remax"). Shape: (B,)."""
    component_scores: Tensor | None = None
    """Each reward kind's score ("gdpo"). Shape: (B, K)."""
    component_weights: Tensor | None = None
    """Weight of each reward kind ("gdpo"). Shape: (K,)."""
    old_logprob: Tensor | None = None
    """log π_old of the sampled tokens ("optimal_token_baseline"). Shape: (B, T)."""
    sum_pi_squared: Tensor | None = None
    """Σ_v π_old(v)² at each position ("optimal_token_baseline"). Shape: (B, T)."""
    token_weights: Tensor | None = None
    """Rollout-correction importance weights, or None ("optimal_token_baseline").
    Shape: (B, T)."""
    gamma: float = 1.0
    """Discount per token ("gae", "reinforce_plus_plus")."""
    lam: float = 1.0
    """GAE λ."""
    normalize_advantages: bool = True
    """"gae" whitens its advantages."""
    norm_adv_by_std: bool = True
    """"grpo" and "grpo_passk" divide by the group std (False: Dr. GRPO)."""
    singleton_groups: str = "zero"
    """What a group of one sample gets in the group estimators
    (:data:`SINGLETON_GROUP_CHOICES`)."""

    def require(self, name: str, estimator: str) -> Tensor:
        """The tensor field ``name``; ValueError if it is None."""
        tensor = getattr(self, name)
        if tensor is None:
            raise ValueError(f"advantage estimator {estimator!r} needs {name}")
        return tensor


AdvantageEstimator = Callable[[Tensor, Tensor, EstimatorInputs], tuple[Tensor, Tensor]]
"""An entry of :data:`ADVANTAGE_ESTIMATORS`: ``(token_rewards (B, T), response_mask
(B, T), inputs) -> (advantages, returns)``, each Shape: (B, T). Outcome estimators use
the masked sum of the token rewards per sequence as its score and return the advantages
as returns."""


def _sequence_scores(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome score per sequence = sum of its token rewards. (B, T) -> (B,)."""
    return masked_sum(token_rewards, response_mask, dim=1)


def _gae_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return compute_gae_advantages_returns(
        token_rewards,
        inputs.require("values", "gae"),
        response_mask,
        inputs.gamma,
        inputs.lam,
        whiten_advantages=inputs.normalize_advantages,
    )


def _group_estimator(
    name: str, advantage_fn: Callable[..., Tensor], divides_by_std: bool = False
) -> AdvantageEstimator:
    """Registry entry for an outcome estimator of scores, groups and the singleton rule
    (and the std switch when ``divides_by_std``)."""

    def estimator(
        token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
    ) -> tuple[Tensor, Tensor]:
        std = {"normalize_by_std": inputs.norm_adv_by_std} if divides_by_std else {}
        advantages = advantage_fn(
            _sequence_scores(token_rewards, response_mask),
            inputs.require("group_ids", name),
            response_mask,
            singleton_groups=inputs.singleton_groups,
            **std,
        )
        return advantages, advantages

    estimator.__name__ = f"_{name}_estimator"
    return estimator


def _reinforce_plus_plus_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return reinforce_plus_plus_advantages(token_rewards, response_mask, inputs.gamma)


def _gdpo_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    # the token rewards' KL penalty is not a reward kind: GDPO reads the kinds' scores
    del token_rewards
    advantages = gdpo_advantages(
        inputs.require("component_scores", "gdpo"),
        inputs.require("component_weights", "gdpo"),
        inputs.require("group_ids", "gdpo"),
        response_mask,
        singleton_groups=inputs.singleton_groups,
    )
    return advantages, advantages


def _remax_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return remax_advantages(
        token_rewards, inputs.require("baseline_scores", "remax"), response_mask
    )


def _optimal_token_baseline_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    name = "optimal_token_baseline"
    return optimal_token_baseline_advantages(
        token_rewards,
        response_mask,
        inputs.require("group_ids", name),
        inputs.require("old_logprob", name),
        inputs.require("sum_pi_squared", name),
        token_weights=inputs.token_weights,
        singleton_groups=inputs.singleton_groups,
    )


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": _gae_estimator,
    "grpo": _group_estimator("grpo", grpo_advantages, divides_by_std=True),
    "rloo": _group_estimator("rloo", rloo_advantages),
    "reinforce_plus_plus": _reinforce_plus_plus_estimator,
    "reinforce_plus_plus_baseline": _group_estimator(
        "reinforce_plus_plus_baseline", reinforce_plus_plus_baseline_advantages
    ),
    "opo": _group_estimator("opo", opo_advantages),
    "gpg": _group_estimator("gpg", gpg_advantages),
    "grpo_passk": _group_estimator("grpo_passk", grpo_passk_advantages, divides_by_std=True),
    "gdpo": _gdpo_estimator,
    "remax": _remax_estimator,
    "optimal_token_baseline": _optimal_token_baseline_estimator,
}
"""Advantage estimators by config name (``algorithm.adv_estimator``)."""

ADVANTAGE_ESTIMATOR_NOTES: dict[str, AlgorithmNote] = {
    "gae": AlgorithmNote(
        "GAE(γ, λ) over critic values per token; needs the critic",
        'Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", arXiv:1506.02438',
    ),
    "grpo": AlgorithmNote(
        "score minus its prompt group's mean, over the group's std "
        "(norm_adv_by_std_in_grpo=false: Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)",
        'Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300',
    ),
    "rloo": AlgorithmNote(
        "score minus the mean score of the other responses to the same prompt",
        'Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE", arXiv:2402.14740',
    ),
    "reinforce_plus_plus": AlgorithmNote(
        "discounted returns-to-go of the token rewards, whitened over the batch; no critic",
        'Hu 2025, "REINFORCE++", arXiv:2501.03262',
    ),
    "reinforce_plus_plus_baseline": AlgorithmNote(
        "score minus its group's mean, whitened over the batch's response tokens",
        'Hu 2025, "REINFORCE++", arXiv:2501.03262',
    ),
    "opo": AlgorithmNote(
        "score minus the response-length-weighted mean score of its group (optimal baseline)",
        'Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585',
    ),
    "gpg": AlgorithmNote(
        "score minus its group's mean, scaled by B/(B-M) (M: samples of all-equal groups); "
        "pair with actor.policy_loss=reinforce",
        'Chu et al. 2025, "GPG: A Simple and Strong RL Baseline for Model Reasoning", '
        "arXiv:2504.02546",
    ),
    "grpo_passk": AlgorithmNote(
        "pass@k: only each group's best response gets a signal, its score minus the "
        "runner-up's, over the group's std",
        'Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using '
        'RL", arXiv:2503.19595',
    ),
    "gdpo": AlgorithmNote(
        "each reward kind (the reward service's scores_<kind>) normalised within its "
        "group, weighted sum, whitened over the batch",
        'Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy '
        'Optimization", arXiv:2601.05242',
    ),
    "remax": AlgorithmNote(
        "return-to-go minus the score of the greedy response to the same prompt (one "
        "extra greedy generation and reward call per prompt)",
        'Li et al. 2024, "ReMax: A Simple, Effective, and Efficient RL Method", arXiv:2310.10505',
    ),
    "optimal_token_baseline": AlgorithmNote(
        "return-to-go minus a per-group, per-position baseline weighted by each path's "
        "accumulated gradient variance (1 - 2π + Σπ²; asks the rollout for Σπ²)",
        'Greensmith et al. 2004, "Variance Reduction Techniques for Gradient Estimates '
        'in RL", JMLR 5; VeRL\'s "optimal_token_baseline"',
    ),
}
"""One line per advantage estimator, with its paper."""

_GROUP = frozenset({"group_ids"})
_ESTIMATOR_NEEDS: dict[str, frozenset[str]] = {
    "gae": frozenset({"values"}),
    "grpo": _GROUP,
    "rloo": _GROUP,
    "reinforce_plus_plus": frozenset(),
    "reinforce_plus_plus_baseline": _GROUP,
    "opo": _GROUP,
    "gpg": _GROUP,
    "grpo_passk": _GROUP,
    "gdpo": _GROUP | {"component_scores", "component_weights"},
    "remax": frozenset({"baseline_scores"}),
    "optimal_token_baseline": _GROUP | {"old_logprob", "sum_pi_squared"},
}


def _check_estimator_name(name: str) -> None:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid choices: "
            f"{', '.join(ADVANTAGE_ESTIMATORS)}"
        )


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; ValueError naming the valid choices if none."""
    _check_estimator_name(name)
    return ADVANTAGE_ESTIMATORS[name]


def estimator_needs(name: str) -> frozenset[str]:
    """The :class:`EstimatorInputs` tensors estimator ``name`` requires (it may also read
    an optional one: the optimal token baseline, ``token_weights``). The run config and
    the trainer ask it which services and requests a run needs: "values" a critic,
    "group_ids" several responses per prompt, "baseline_scores" a greedy generation,
    "component_scores" each reward kind's score, "sum_pi_squared" Σπ² from the rollout."""
    _check_estimator_name(name)
    return _ESTIMATOR_NEEDS[name]


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` needs critic values (so a critic service must run)."""
    return "values" in estimator_needs(name)


def needs_group_ids(name: str) -> bool:
    """Whether estimator ``name`` compares samples of the same prompt (n > 1 per prompt)."""
    return "group_ids" in estimator_needs(name)


# ------------------------------------------------------------------------ losses


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position, in nats.

    ``H = logsumexp(z) - Σ softmax(z)·z``: no log of a probability is taken, so it is
    stable for large logits; ``-inf`` logits (masked vocabulary) contribute 0.

    Args:
        logits: Unnormalised log-probs. Shape: (B, T, V) (any leading dims).

    Returns:
        Entropy per position. Shape: (B, T).
    """
    probs = torch.softmax(logits, dim=-1)
    # -inf logits have probability 0; zero them so 0·(-inf) does not give nan
    finite_logits = torch.where(torch.isneginf(logits), torch.zeros_like(logits), logits)
    # H = -Σ p·log p = -Σ p·(z - logsumexp z) = logsumexp z - Σ p·z
    return torch.logsumexp(logits, dim=-1) - (probs * finite_logits).sum(dim=-1)


LOSS_AGG_MODE_NOTES: dict[str, AlgorithmNote] = {
    "token-mean": AlgorithmNote(
        "mean over all response tokens of the micro-batch (every token weighs the same)",
        'Yu et al. 2025, "DAPO", arXiv:2503.14476',
    ),
    "seq-mean-token-sum": AlgorithmNote(
        "sum over each sequence's tokens, mean over sequences",
        "VeRL's aggregation modes",
    ),
    "seq-mean-token-mean": AlgorithmNote(
        "mean over each sequence's tokens, mean over sequences (every sequence weighs the same)",
        'Shao et al. 2024, "DeepSeekMath" (GRPO), arXiv:2402.03300',
    ),
    "token-sum": AlgorithmNote(
        "sum over all response tokens of the micro-batch (no normaliser)",
        "VeRL's aggregation modes",
    ),
    "seq-mean-token-sum-norm": AlgorithmNote(
        "each sequence's token sum over a constant (the padded response length, "
        "rollout.max_new_tokens), mean over sequences: no length bias",
        'Liu et al. 2025, "Understanding R1-Zero-Like Training" (Dr. GRPO), arXiv:2503.20783',
    ),
}
"""One line per loss aggregation mode, with its source."""

LOSS_AGG_MODES: tuple[str, ...] = tuple(LOSS_AGG_MODE_NOTES)
"""Names accepted by :func:`aggregate_loss`."""


def aggregate_loss(
    loss_mat: Tensor, response_mask: Tensor, mode: str, *, norm_tokens: float | None = None
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    - ``"token-mean"``: mean over all response tokens of the batch (every token
      weighs the same; DAPO's choice).
    - ``"seq-mean-token-sum"``: sum over each sequence's tokens, mean over sequences.
    - ``"seq-mean-token-mean"``: mean over each sequence's tokens, mean over
      sequences (every sequence weighs the same; the original GRPO).
    - ``"token-sum"``: sum over all response tokens (0 for an empty mask).
    - ``"seq-mean-token-sum-norm"``: each sequence's token sum divided by the constant
      ``norm_tokens``, mean over sequences (Dr. GRPO, Liu et al., 2025,
      arXiv:2503.20783: a per-sequence ``1/|y|`` favours long wrong answers and short
      right ones; a constant divisor removes that bias). ``norm_tokens`` defaults to
      T, the padded response length, which in the actor is always
      ``rollout.max_new_tokens`` (responses are padded to it), so it is constant over a
      run. VeRL divides the *sum* over sequences instead of the mean, which makes the
      loss grow with the micro-batch size; the mean here matches the paper's 1/G.

    Sequences without any response token (padding rows) are left out of the
    sequence means. The mean is over this call's tokens/sequences: a trainer that
    accumulates gradients over micro-batches scales accordingly.

    Args:
        loss_mat: Per-token loss. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        mode: One of :data:`LOSS_AGG_MODES`.
        norm_tokens: The constant of ``"seq-mean-token-sum-norm"`` (> 0); None = T.

    Returns:
        The loss. Shape: () (0-dim).

    Raises:
        ValueError: On bad shapes, an unknown ``mode``, a non-positive ``norm_tokens``
            or an all-zero mask (except for ``"token-sum"``).
    """
    _check_2d("loss_mat", loss_mat)
    _check_same_shape(loss_mat=loss_mat, response_mask=response_mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    if norm_tokens is not None and not norm_tokens > 0:
        raise ValueError(f"norm_tokens must be > 0 (or None for T), got {norm_tokens}")
    if mode == "token-mean":
        return masked_mean(loss_mat, response_mask)
    if mode == "token-sum":
        return masked_sum(loss_mat, response_mask)
    # one value per sequence: token sum, token sum over a constant, or token mean
    if mode == "seq-mean-token-sum":
        per_sequence = masked_sum(loss_mat, response_mask, dim=1)
    elif mode == "seq-mean-token-sum-norm":
        constant = loss_mat.shape[1] if norm_tokens is None else norm_tokens
        per_sequence = masked_sum(loss_mat, response_mask, dim=1) / constant
    else:
        per_sequence = masked_mean(loss_mat, response_mask, dim=1)
    # average over the sequences that have at least one response token
    return masked_mean(per_sequence, response_mask.bool().any(dim=1))


def mini_batch_loss_scale(
    response_mask: Tensor,
    mode: str,
    *,
    mini_batch_tokens: float,
    mini_batch_sequences: float,
    ranks: int,
    accumulation_steps: int,
) -> Tensor:
    """Factor that makes a micro-batch's :func:`aggregate_loss` its share of the loss over
    the whole mini-batch, so the gradient does not depend on how the mini-batch is split
    over data-parallel ranks and micro-batches.

    :func:`aggregate_loss` divides by the micro-batch's own count (tokens for
    "token-mean", sequences with a token for the "seq-mean-*" modes), and the training
    engine then averages the micro-batches' gradients (÷ accumulation_steps) and the
    ranks' (÷ ranks). With ``n`` the micro-batch's count and ``N`` the mini-batch's::

        scale = n / N · ranks · accumulation_steps     (token-mean, seq-mean-*)
        scale = ranks · accumulation_steps             (token-sum: the mini-batch's sum)

    so the sum over micro-batches and mean over ranks of ``scale · loss`` is the loss of
    the mini-batch taken as one batch (VeRL's global-batch normalisation).

    Args:
        response_mask: The micro-batch's response mask. Shape: (B, T).
        mode: One of :data:`LOSS_AGG_MODES`.
        mini_batch_tokens: Response tokens in the whole mini-batch, every rank (> 0).
        mini_batch_sequences: Sequences with a response token in it, every rank (> 0).
        ranks: Data-parallel ranks the mini-batch is split over (>= 1).
        accumulation_steps: Micro-batches per rank in the mini-batch (>= 1).

    Returns:
        The factor. Shape: () (0-dim).

    Raises:
        ValueError: On an unknown mode or non-positive counts.
    """
    _check_2d("response_mask", response_mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    if not (mini_batch_tokens > 0 and mini_batch_sequences > 0):
        raise ValueError(
            "mini_batch_tokens and mini_batch_sequences must be > 0, got "
            f"{mini_batch_tokens} and {mini_batch_sequences}"
        )
    if ranks < 1 or accumulation_steps < 1:
        raise ValueError(
            f"ranks and accumulation_steps must be >= 1, got {ranks}, {accumulation_steps}"
        )
    mask = response_mask.bool()
    averaged_over = float(ranks * accumulation_steps)
    if mode == "token-sum":
        return torch.tensor(averaged_over)
    if mode == "token-mean":
        share = mask.sum() / mini_batch_tokens
    else:
        share = mask.any(dim=1).sum() / mini_batch_sequences
    return share.to(torch.float32) * averaged_over


def _check_policy_inputs(
    old_logprob: Tensor, logprob: Tensor, advantages: Tensor, response_mask: Tensor
) -> None:
    _check_2d("logprob", logprob)
    _check_same_shape(
        logprob=logprob,
        old_logprob=old_logprob,
        advantages=advantages,
        response_mask=response_mask,
    )


def _check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0 <= clip_ratio_low < 1:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")


def _inside_mask(mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors with 0 outside the mask, so padding garbage reaches neither a value
    nor a gradient (``where`` sends no gradient to the entries it drops)."""
    return tuple(torch.where(mask, t, torch.zeros_like(t)) for t in tensors)


def _clamped_log_ratio(logprob: Tensor, old_logprob: Tensor) -> Tensor:
    """log ρ = log π_θ - log π_old, clamped so exp() cannot overflow."""
    return torch.clamp(logprob - old_logprob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _policy_metrics(
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


def policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
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
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
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
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    if clip_ratio_dual is not None and clip_ratio_dual <= 1:
        raise ValueError(f"clip_ratio_dual must be > 1 (or None), got {clip_ratio_dual}")
    mask = response_mask.bool()
    # log ρ, clamped so exp() cannot overflow on garbage or wildly stale tokens
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
    ratio = torch.exp(log_ratio)
    # unclipped surrogate, negated so that minimising it ascends the objective
    unclipped = -advantages * ratio
    # surrogate with ρ kept in the trust region [1 - ε_low, 1 + ε_high]
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    # pessimistic bound: take the larger loss (= smaller objective)
    losses = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).to(logprob.dtype), mask)
    if clip_ratio_dual is None:
        clipfrac_lower = None
    else:
        # dual clip: for A < 0 the loss -A·ρ grows without bound in ρ; cap it at -A·c
        dual_bound = -advantages * clip_ratio_dual
        negative = advantages < 0
        clipfrac_lower = masked_mean(((losses > dual_bound) & negative).to(logprob.dtype), mask)
        losses = torch.where(negative, torch.minimum(losses, dual_bound), losses)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, _policy_metrics(loss, log_ratio, mask, clipfrac, clipfrac_lower)


def gspo_loss(
    old_logprob: Tensor,
    logprob: Tensor,
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
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
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
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    mask = response_mask.bool()
    old_logprob, logprob, advantages = _inside_mask(mask, old_logprob, logprob, advantages)
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
    # log s_i: the mean token log-ratio of each sequence (0 for a row without tokens)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=1)
    # value log s_i on every token, gradient ∇log π_θ(y_t) (logprob - sg[logprob] = 0)
    token_log_ratio = seq_log_ratio.detach()[:, None] + (logprob - logprob.detach())
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    # pessimistic bound per token, with the sequence's ratio
    losses = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).to(logprob.dtype), mask)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, _policy_metrics(loss, log_ratio, mask, clipfrac)


def cispo_loss(
    old_logprob: Tensor,
    logprob: Tensor,
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
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
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
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    mask = response_mask.bool()
    old_logprob, logprob, advantages = _inside_mask(mask, old_logprob, logprob, advantages)
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
    ratio = torch.exp(log_ratio)
    # the clipped importance weight, a constant for the gradient
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    # value 1, gradient ∇log π_θ: a REINFORCE term weighted by ŵ·A
    score_function = torch.exp(logprob - logprob.detach())
    losses = -advantages * weight * score_function
    clipfrac = masked_mean((weight != ratio.detach()).to(logprob.dtype), mask)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, _policy_metrics(loss, log_ratio, mask, clipfrac)


def gmpo_loss(
    old_logprob: Tensor,
    logprob: Tensor,
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
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
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
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    mask = response_mask.bool()
    old_logprob, logprob, advantages = _inside_mask(mask, old_logprob, logprob, advantages)
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
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
    clipfrac = masked_mean(active.to(logprob.dtype), mask)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, _policy_metrics(loss, log_ratio, mask, clipfrac)


def _token_covariance(advantages: Tensor, logprob: Tensor, mask: Tensor) -> Tensor:
    """Per-token centred product ``(A_t - mean A)·(log π_t - mean log π)``, means over
    the response tokens, detached. Shape: (B, T); 0 outside the mask."""
    advantages, logprob = advantages.detach(), logprob.detach()
    covariance = (advantages - masked_mean(advantages, mask)) * (
        logprob - masked_mean(logprob, mask)
    )
    return torch.where(mask, covariance, torch.zeros_like(covariance))


def _top_k_mask(candidates: Tensor, score: Tensor, k: Tensor) -> Tensor:
    """The (at most) k candidates with the highest score; ties go to the earlier
    position (row-major). Shape: candidates'. No host sync: k may be a tensor."""
    flat_score = torch.where(candidates, score, torch.full_like(score, -math.inf)).flatten()
    order = torch.argsort(flat_score, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return candidates & (rank.view(candidates.shape) < k)


def _covariance_token_count(mask: Tensor, fraction: float) -> Tensor:
    """max(1, ⌊fraction · response tokens⌋), as a tensor."""
    return torch.clamp(torch.floor(fraction * mask.sum().to(torch.float64)), min=1)


def clip_cov_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    cov_fraction: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    loss_agg_mode: str = "token-mean",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models", arXiv:2505.22617).

    Entropy falls where a token's log-prob and advantage co-vary: a likely token with a
    high advantage gets likelier. Clip-Cov takes the PPO clipped loss (:func:`policy_loss`
    without dual clip), computes each token's centred product
    ``Cov_t = (A_t - mean A)·(log π_t - mean log π)`` (means over the batch's response
    tokens), and among the tokens the ε clip left alone whose ``cov_low < Cov_t <
    cov_high`` picks ``max(1, ⌊cov_fraction · N⌋)`` at random (N response tokens). The
    picked tokens' loss is set to 0: no value, no gradient (the paper's "else 0").
    The paper runs it with a wide ε clip; ε here is ``clip_ratio_low/high``.

    Args:
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: ε_low of the PPO clip.
        clip_ratio_high: ε_high of the PPO clip.
        cov_fraction: Fraction of the response tokens to exclude (the paper's r, 2e-4).
        cov_low: Lower covariance bound ω_low (exclusive).
        cov_high: Upper covariance bound ω_high (exclusive).
        loss_agg_mode: See :func:`aggregate_loss`.
        generator: Random source of the pick; None = torch's global one.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`, plus ``"pg_cov_frac"``: the fraction
        of response tokens picked.

    Raises:
        ValueError: On bad shapes or settings, an unknown mode or an empty mask.
    """
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    _check_unit_interval("cov_fraction", cov_fraction)
    if not cov_low < cov_high:
        raise ValueError(f"cov_low must be < cov_high, got {cov_low} and {cov_high}")
    mask = response_mask.bool()
    old_logprob, logprob, advantages = _inside_mask(mask, old_logprob, logprob, advantages)
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    clipped_tokens = mask & (clipped > unclipped)
    covariance = _token_covariance(advantages, logprob, mask)
    # tokens in the covariance band the ε clip has not already silenced
    eligible = mask & ~clipped_tokens & (covariance > cov_low) & (covariance < cov_high)
    # a uniform random subset: the k eligible tokens with the largest random keys
    keys = torch.rand(mask.shape, generator=generator, device=mask.device)
    picked = _top_k_mask(eligible, keys, _covariance_token_count(mask, cov_fraction))
    losses = torch.where(picked, torch.zeros_like(losses), losses)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    metrics = _policy_metrics(
        loss, log_ratio, mask, masked_mean(clipped_tokens.to(ratio.dtype), mask)
    )
    metrics["pg_cov_frac"] = masked_mean(picked.to(ratio.dtype), mask).detach()
    return loss, metrics


def kl_cov_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    cov_fraction: float = 2e-3,
    kl_cov_coef: float = 1.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models", arXiv:2505.22617).

    No ratio clip: every token has the plain surrogate ``-A_t·ρ_t``, and the
    ``k = max(1, ⌊cov_fraction · N⌋)`` response tokens with the largest centred product
    ``Cov_t = (A_t - mean A)·(log π_t - mean log π)`` also pay ``β·|log ρ_t|``, a KL
    penalty that holds exactly those tokens near the sampling policy::

        L_t = -A_t·ρ_t + β·|log ρ_t|·[t in top-k by Cov]

    Args:
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        cov_fraction: Fraction of the response tokens penalised (the paper's k: 2e-3 for
            7B models, 2e-4 for 32B).
        kl_cov_coef: β (>= 0), the paper's 1.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`, plus ``"pg_cov_frac"``: the fraction
        of response tokens penalised.

    Raises:
        ValueError: On bad shapes or settings, an unknown mode or an empty mask.
    """
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    _check_unit_interval("cov_fraction", cov_fraction)
    if kl_cov_coef < 0:
        raise ValueError(f"kl_cov_coef must be >= 0, got {kl_cov_coef}")
    mask = response_mask.bool()
    old_logprob, logprob, advantages = _inside_mask(mask, old_logprob, logprob, advantages)
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
    covariance = _token_covariance(advantages, logprob, mask)
    picked = _top_k_mask(mask, covariance, _covariance_token_count(mask, cov_fraction))
    # the plain surrogate, plus β·|log ρ| on the highest-covariance tokens
    penalty = kl_cov_coef * log_ratio.abs()
    losses = -advantages * torch.exp(log_ratio) + torch.where(
        picked, penalty, torch.zeros_like(penalty)
    )
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    metrics = _policy_metrics(loss, log_ratio, mask)
    metrics["pg_cov_frac"] = masked_mean(picked.to(log_ratio.dtype), mask).detach()
    return loss, metrics


def reinforce_loss(
    old_logprob: Tensor,
    logprob: Tensor,
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
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss` (both clip fractions 0).

    Raises:
        ValueError: On bad shapes, an unknown mode or an empty mask.
    """
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    mask = response_mask.bool()
    old_logprob, logprob, advantages = _inside_mask(mask, old_logprob, logprob, advantages)
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
    losses = -advantages * torch.exp(log_ratio)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, _policy_metrics(loss, log_ratio, mask)


def sapo_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
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
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        tau_pos: Gate temperature for positive advantages (> 0).
        tau_neg: Gate temperature for zero or negative advantages (> 0).
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss` (both clip fractions 0: nothing is
        clipped).

    Raises:
        ValueError: On bad shapes, a temperature <= 0, an unknown mode or an empty mask.
    """
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos} and {tau_neg}")
    mask = response_mask.bool()
    old_logprob, logprob, advantages = _inside_mask(mask, old_logprob, logprob, advantages)
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.full_like(ratio, tau_pos),
        torch.full_like(ratio, tau_neg),
    )
    # the soft gate: value 1 and slope 1 at ρ = 1, flat far from it
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    losses = -gate * advantages
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    return loss, _policy_metrics(loss, log_ratio, mask)


def _divergence_masked_loss(
    logprob: Tensor,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    inside: Tensor,
    max_ratio: float,
    loss_agg_mode: str,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's shared step: policy gradient weighted by the truncated ratio on the tokens
    ``inside`` the trust region, none elsewhere."""
    ratio = torch.exp(log_ratio)
    # sg[min(ρ, C)]·∇log π = ∇ρ below the cap: the unclipped surrogate's gradient
    weight = torch.clamp(ratio, max=max_ratio).detach()
    score_function = torch.exp(logprob - logprob.detach())
    kept = inside.to(logprob.dtype)
    losses = -advantages * weight * kept * score_function
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    outside = masked_mean(1 - kept, mask)
    capped = masked_mean(((ratio > max_ratio) & inside).to(logprob.dtype), mask)
    return loss, _policy_metrics(loss, log_ratio, mask, outside, capped)


def _check_dppo(clip_ratio_low: float, clip_ratio_high: float, max_ratio: float) -> None:
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"DPPO divergence thresholds must be >= 0, got {clip_ratio_low} and {clip_ratio_high}"
        )
    if not max_ratio > 0:
        raise ValueError(f"max_ratio must be > 0, got {max_ratio}")


def dppo_tv_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.15,
    clip_ratio_high: float = 0.15,
    max_ratio: float = 20.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV: a trust region on the sampled token's probability, not its ratio
    (Qi et al., 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv:2602.04879).

    PPO's ratio clip is loose for likely tokens (p 0.9 → 1.0 is ratio 1.1) and harsh for
    rare ones (p 0.001 → 0.01 is ratio 10). DPPO bounds the change of probability
    itself, the total variation of the binary (token, not token) distribution, on the
    side the advantage pushes::

        inside_t = p_t - p_old,t <= δ_high   where A_t > 0
                   p_t - p_old,t >= -δ_low   otherwise
        L_t = -A_t · sg[min(ρ_t, C)] · ∇log π_θ(y_t) · inside_t    (value -A·sg[min(ρ, C)])

    ``C`` truncates the importance weight (the paper uses it instead of a dual clip;
    keep it large: truncation biases the gradient).

    Args:
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: δ_low, the most a negative-advantage token's probability may fall.
        clip_ratio_high: δ_high, the most a positive-advantage token's probability may rise.
        max_ratio: C > 0, the cap on the importance weight.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`; ``"pg_clipfrac"`` is the fraction of
        response tokens outside the trust region, ``"pg_clipfrac_lower"`` of those inside
        whose weight was capped.

    Raises:
        ValueError: On bad shapes, negative thresholds, a cap <= 0, an unknown mode or an
            empty mask.
    """
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    _check_dppo(clip_ratio_low, clip_ratio_high, max_ratio)
    mask = response_mask.bool()
    old_logprob, logprob, advantages = _inside_mask(mask, old_logprob, logprob, advantages)
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
    change = (torch.exp(logprob) - torch.exp(old_logprob)).detach()
    inside = torch.where(advantages > 0, change <= clip_ratio_high, change >= -clip_ratio_low)
    return _divergence_masked_loss(
        logprob, log_ratio, advantages, mask, inside, max_ratio, loss_agg_mode
    )


def dppo_kl_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.05,
    clip_ratio_high: float = 0.05,
    max_ratio: float = 20.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (Qi et al., 2026, arXiv:2602.04879): :func:`dppo_tv_loss` with the
    KL divergence of the binary distributions (p_old, 1 - p_old) ‖ (p, 1 - p) as the
    trust region::

        D_t = p_old·log(p_old/p) + (1 - p_old)·log((1 - p_old)/(1 - p))
        inside_t = D_t <= δ_high or p <= p_old   where A_t > 0
                   D_t <= δ_low  or p >= p_old   otherwise

    A token moving against its advantage's push stays inside whatever its divergence
    (the update would bring it back). The default δ = 0.05 is rlserve's: by Pinsker's
    inequality a TV of 0.15 (the paper's DPPO-TV threshold) is a binary KL of at least
    2·0.15² = 0.045.

    Args:
        old_logprob: Log-probs under the sampling policy. Shape: (B, T).
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: δ_low, the divergence allowed to a negative-advantage token.
        clip_ratio_high: δ_high, the divergence allowed to a positive-advantage token.
        max_ratio: C > 0, the cap on the importance weight.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`dppo_tv_loss`.

    Raises:
        ValueError: On bad shapes, negative thresholds, a cap <= 0, an unknown mode or an
            empty mask.
    """
    _check_policy_inputs(old_logprob, logprob, advantages, response_mask)
    _check_dppo(clip_ratio_low, clip_ratio_high, max_ratio)
    mask = response_mask.bool()
    old_logprob, logprob, advantages = _inside_mask(mask, old_logprob, logprob, advantages)
    log_ratio = _clamped_log_ratio(logprob, old_logprob)
    new_logprob = logprob.detach()
    p_old, p = torch.exp(old_logprob), torch.exp(new_logprob)
    # the 1e-8 keeps log(1 - p) finite for a token of probability 1
    divergence = p_old * (old_logprob - new_logprob) + (1 - p_old) * (
        torch.log(1 - p_old + 1e-8) - torch.log(1 - p + 1e-8)
    )
    inside = torch.where(
        advantages > 0,
        (divergence <= clip_ratio_high) | (p <= p_old),
        (divergence <= clip_ratio_low) | (p >= p_old),
    )
    return _divergence_masked_loss(
        logprob, log_ratio, advantages, mask, inside, max_ratio, loss_agg_mode
    )


class PolicyLoss(Protocol):
    """Uniform signature of the entries of :data:`POLICY_LOSSES`.

    Each loss reads the knobs it has and ignores the others: ``clip_ratio_low/high``
    (vanilla, gspo, cispo, gmpo, clip_cov; the divergence thresholds of dppo_tv and
    dppo_kl; None = the loss's own default, :data:`DEFAULT_CLIP_RATIOS`),
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


def _policy_loss_entry(name: str) -> PolicyLoss:
    """The registry entry for ``name``: the uniform signature, passing each loss only
    the knobs it reads (listed once, here)."""

    def entry(
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
    ) -> tuple[Tensor, dict[str, Tensor]]:
        inputs = (old_logprob, logprob, advantages, response_mask)
        low, high = resolve_clip_ratios(name, clip_ratio_low, clip_ratio_high)
        clip = {"clip_ratio_low": low, "clip_ratio_high": high}
        if name == "vanilla":
            return policy_loss(
                *inputs, **clip, clip_ratio_dual=clip_ratio_dual, loss_agg_mode=loss_agg_mode
            )
        if name == "gspo":
            return gspo_loss(*inputs, **clip, loss_agg_mode=loss_agg_mode)
        if name == "cispo":
            return cispo_loss(*inputs, **clip, loss_agg_mode=loss_agg_mode)
        if name == "gmpo":
            return gmpo_loss(*inputs, **clip, loss_agg_mode=loss_agg_mode)
        if name == "clip_cov":
            return clip_cov_loss(
                *inputs,
                **clip,
                cov_fraction=clip_cov_fraction,
                cov_low=clip_cov_low,
                cov_high=clip_cov_high,
                loss_agg_mode=loss_agg_mode,
                generator=generator,
            )
        if name == "kl_cov":
            return kl_cov_loss(
                *inputs,
                cov_fraction=kl_cov_fraction,
                kl_cov_coef=kl_cov_coef,
                loss_agg_mode=loss_agg_mode,
            )
        if name == "reinforce":
            return reinforce_loss(*inputs, loss_agg_mode=loss_agg_mode)
        if name == "sapo":
            return sapo_loss(
                *inputs, tau_pos=sapo_tau_pos, tau_neg=sapo_tau_neg, loss_agg_mode=loss_agg_mode
            )
        if name == "dppo_tv":
            return dppo_tv_loss(
                *inputs, **clip, max_ratio=dppo_max_ratio, loss_agg_mode=loss_agg_mode
            )
        if name == "dppo_kl":
            return dppo_kl_loss(
                *inputs, **clip, max_ratio=dppo_max_ratio, loss_agg_mode=loss_agg_mode
            )
        raise ValueError(f"no policy loss {name!r}")  # unreachable: names come from the notes

    entry.__name__ = f"_{name}_policy_loss"
    return entry


POLICY_LOSS_NOTES: dict[str, AlgorithmNote] = {
    "vanilla": AlgorithmNote(
        "PPO clipped surrogate on token ratios, optional dual clip (actor.clip_ratio_dual)",
        'Schulman et al. 2017, "Proximal Policy Optimization", arXiv:1707.06347; dual clip: '
        "Ye et al. 2020, arXiv:1912.09729",
    ),
    "gspo": AlgorithmNote(
        "one ratio per sequence (geometric mean of token ratios), clipped per sequence; "
        "use tiny clip ratios (3e-4/4e-4) and seq-mean-token-mean",
        'Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071',
    ),
    "cispo": AlgorithmNote(
        "REINFORCE term weighted by the clipped, stop-gradient ratio: clipped tokens "
        "keep their gradient",
        'MiniMax 2025, "MiniMax-M1", arXiv:2506.13585',
    ),
    "gmpo": AlgorithmNote(
        "geometric mean of log-space-clipped token ratios per sequence; paper's clip "
        "range (e^-0.4, e^0.4) is clip_ratio_low 0.33, clip_ratio_high 0.49",
        'Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673',
    ),
    "clip_cov": AlgorithmNote(
        "PPO clip, and a random few tokens with advantage-logprob covariance in "
        "(clip_cov_low, clip_cov_high) get no gradient",
        'Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617',
    ),
    "kl_cov": AlgorithmNote(
        "unclipped surrogate, plus kl_cov_coef·|log ratio| on the top kl_cov_fraction "
        "tokens by advantage-logprob covariance",
        'Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617',
    ),
    "reinforce": AlgorithmNote(
        "-A·ratio, no clip: REINFORCE's gradient on-policy, importance-weighted after",
        'Williams 1992, "Simple Statistical Gradient-Following Algorithms"',
    ),
    "sapo": AlgorithmNote(
        "soft gate (4/τ)·σ(τ(ratio-1)) instead of a clip, τ = actor.sapo_tau_pos/neg by "
        "the advantage's sign; use seq-mean-token-mean",
        'Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347',
    ),
    "dppo_tv": AlgorithmNote(
        "policy gradient only where the token's probability moved less than "
        "clip_ratio_low/high (total variation, default 0.15), ratio capped at "
        "actor.dppo_max_ratio",
        'Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv:2602.04879',
    ),
    "dppo_kl": AlgorithmNote(
        "dppo_tv with the binary KL of the token's probability as the trust region (default 0.05)",
        'Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv:2602.04879',
    ),
}
"""One line per policy loss, with its paper."""

DEFAULT_CLIP_RATIOS: dict[str, tuple[float, float]] = {
    "vanilla": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "cispo": (0.2, 0.2),
    "gmpo": (1 - math.exp(-0.4), math.exp(0.4) - 1),
    "clip_cov": (0.2, 0.2),
    "dppo_tv": (0.15, 0.15),
    "dppo_kl": (0.05, 0.05),
}
"""(clip_ratio_low, clip_ratio_high) each loss uses when the config leaves them unset:
its paper's values (PPO's 0.2; GSPO's sequence-ratio range; GMPO's (e^-0.4, e^0.4);
DPPO's divergence thresholds). Losses without a clip (kl_cov, reinforce, sapo) are not
listed."""


def resolve_clip_ratios(
    policy_loss_name: str, clip_ratio_low: float | None, clip_ratio_high: float | None
) -> tuple[float, float]:
    """The clip range ``policy_loss_name`` trains with: each value given, else the loss's
    default (:data:`DEFAULT_CLIP_RATIOS`; PPO's 0.2 for a loss that reads no clip)."""
    default_low, default_high = DEFAULT_CLIP_RATIOS.get(policy_loss_name, (0.2, 0.2))
    return (
        default_low if clip_ratio_low is None else clip_ratio_low,
        default_high if clip_ratio_high is None else clip_ratio_high,
    )


POLICY_LOSSES: dict[str, PolicyLoss] = {
    name: _policy_loss_entry(name) for name in POLICY_LOSS_NOTES
}
"""Policy losses by config name (``actor.policy_loss``), all with the :class:`PolicyLoss`
signature; "vanilla" is :func:`policy_loss`."""


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; ValueError naming the valid choices if none."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid choices: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_range: float = 0.2,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5·max((V - R)², (clip(V, V_old ± ε) - R)²)``.

    Args:
        values: Current critic predictions (with grad). Shape: (B, T).
        old_values: Predictions when the batch was made. Shape: (B, T).
        returns: Targets (see :func:`compute_gae_advantages_returns`). Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_range: ε, in value units (>= 0); predictions move at most ε from
            ``old_values`` before the clipped term takes over.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``; ``loss`` Shape: (). ``metrics`` (detached, 0-dim):
        ``"vf_loss"`` (the loss) and ``"vf_clipfrac"`` (fraction of response tokens
        where the clipped term is the larger one).

    Raises:
        ValueError: On bad shapes, a negative ``clip_range``, an unknown mode or an
            empty mask.
    """
    _check_2d("values", values)
    _check_same_shape(
        values=values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    if clip_range < 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}")
    mask = response_mask.bool()
    # keep the new prediction within ε of the one the advantages were computed with
    clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    # pessimistic: the larger error, so clipping never rewards a big jump
    losses = torch.maximum(unclipped_error, clipped_error)
    # the 0.5 makes the gradient (V - R), the usual squared-error convention
    loss = 0.5 * aggregate_loss(losses, mask, loss_agg_mode)
    clipfrac = masked_mean((clipped_error > unclipped_error).to(values.dtype), mask)
    return loss, {"vf_loss": loss.detach(), "vf_clipfrac": clipfrac.detach()}


def kl_loss(
    logprob: Tensor,
    ref_logprob: Tensor,
    response_mask: Tensor,
    *,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL(π_θ ‖ π_ref) as a loss term (GRPO's anchor, instead of KL in the reward).

    Args:
        logprob: Log-probs under the current policy (with grad). Shape: (B, T).
        ref_logprob: Log-probs under the reference policy. Shape: (B, T).
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
    _check_same_shape(logprob=logprob, ref_logprob=ref_logprob, response_mask=response_mask)
    # per-token KL estimate, aggregated like the policy loss it is added to
    loss = aggregate_loss(kl_penalty(logprob, ref_logprob, kind), response_mask, loss_agg_mode)
    return loss, {"kl_loss": loss.detach()}
