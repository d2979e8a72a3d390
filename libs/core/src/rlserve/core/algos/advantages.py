"""Advantage estimators: GAE over critic values, and the outcome estimators that need
no critic (GRPO, RLOO, REINFORCE++ and its group baseline, OPO, GPG, GRPO pass@k, GDPO,
ReMax, the optimal token baseline).

Each estimator is one function, registered by config name where it is defined
(:func:`~rlserve.core.algos.advantage_registry.register_estimator`): ``(token_rewards,
response_mask, *, <the EstimatorInputs fields it reads>) -> (advantages, returns)``,
each Shape: (B, T). The outcome estimators score a sequence by the masked sum of its
token rewards and return their advantages as returns too.

Every one runs under ``torch.no_grad()``: advantages and returns are targets, never
differentiated through. The group estimators compare the responses to one prompt; a
group of one sample gets advantage 0 by default (:data:`SINGLETON_GROUP_CHOICES`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlserve.core.algos.advantage_registry import register_estimator
from rlserve.core.algos.masked import (
    check_2d,
    check_same_shape,
    check_unit_interval,
    inside_mask,
    masked_sum,
    masked_whiten,
)
from rlserve.core.algos.notes import AlgorithmNote

_GROUP = frozenset({"group_ids"})


@register_estimator(
    "gae",
    needs={"values"},
    note=AlgorithmNote(
        "GAE(γ, λ) over critic values per token; needs the critic",
        'Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", arXiv:1506.02438',
    ),
)
@torch.no_grad()
def compute_gae_advantages_returns(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor,
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
        response_mask: 1 for response tokens. Shape: (B, T).
        values: Critic value per token (V(s_t) before token t is emitted). Shape: (B, T).
        gamma: Discount per valid token, in [0, 1].
        lam: GAE λ, in [0, 1] (0 = one-step TD, 1 = Monte Carlo).
        whiten_advantages: Whiten advantages over the mask (the returns are not).

    Returns:
        ``(advantages, returns)``, both Shape: (B, T) and 0 outside the mask;
        ``returns = advantages (before whitening) + values`` (the critic's target).

    Raises:
        ValueError: On bad shapes or gamma/lam outside [0, 1].
    """
    check_2d("token_rewards", token_rewards)
    check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    check_unit_interval("gamma", gamma)
    check_unit_interval("lam", lam)
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


def _groups(group_ids: Tensor, response_mask: Tensor) -> tuple[Tensor, int]:
    """Check the group ids (integers, one per row of the (B, T) mask) and map them to
    0..G-1. Returns (index (B,), G)."""
    check_2d("response_mask", response_mask)
    rows = response_mask.shape[0]
    if group_ids.shape != (rows,):
        raise ValueError(
            f"group_ids has shape {tuple(group_ids.shape)} but response_mask has {rows} "
            f"rows; it must be ({rows},)"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
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


def _grouped_scores(
    token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor
) -> tuple[Tensor, Tensor, int, Tensor]:
    """What every outcome estimator starts from, its inputs checked: each sequence's
    score (the masked sum of its token rewards, as floating point), each sample's group
    index (0..G-1), G, and the size of each sample's group. Shapes: (B,), (B,), -, (B,)."""
    check_2d("token_rewards", token_rewards)
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    index, num_groups = _groups(group_ids, response_mask)
    scores = _outcome_scores(masked_sum(token_rewards, response_mask, dim=1))
    return scores, index, num_groups, _group_sum(torch.ones_like(scores), index, num_groups)


def _broadcast_over_mask(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """Spread one value per sequence over its response tokens. (B,) -> (B, T)."""
    expanded = per_sequence[:, None].expand(response_mask.shape)
    return torch.where(response_mask.bool(), expanded, torch.zeros_like(expanded))


def _outcome(per_sequence: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """An outcome estimator's ``(advantages, returns)``: the sequence advantage on each
    of its response tokens, which serves as the returns too. (B,) -> 2 x (B, T)."""
    advantages = _broadcast_over_mask(per_sequence, response_mask)
    return advantages, advantages


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


def _group_normalised(
    scores: Tensor,
    index: Tensor,
    num_groups: int,
    count: Tensor,
    norm_adv_by_std_in_grpo: bool,
    eps: float,
    singleton_groups: str,
) -> Tensor:
    """GRPO's advantage of each (B,) score within its group (see :func:`grpo_advantages`).
    Shape: (B,)."""
    # group mean: the baseline shared by all samples of one prompt
    mean = _group_sum(scores, index, num_groups) / count
    centred = scores - mean
    if norm_adv_by_std_in_grpo:
        # scale-free advantage: how many group stds above the group mean
        centred = centred / (_group_std(centred, index, num_groups, count) + eps)
    # one sample has nothing to be compared with
    return torch.where(count > 1, centred, _singleton_advantage(scores, singleton_groups))


@register_estimator(
    "grpo",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus its prompt group's mean, over the group's std "
        "(norm_adv_by_std_in_grpo=false: Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)",
        'Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300',
    ),
)
@torch.no_grad()
def grpo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    singleton_groups: str = "zero",
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantages (Shao et al., 2024, arXiv:2402.03300).

    ``A_i = (s_i - mean_g) / (std_g + eps)`` with the unbiased std of the group, or
    ``s_i - mean_g`` when ``norm_adv_by_std_in_grpo`` is False (Dr. GRPO, Liu et al., 2025,
    arXiv:2503.20783: the std divisor up-weights prompts that are too easy or too hard).

    Args:
        token_rewards: Reward per token; a row's masked sum is its score. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        norm_adv_by_std_in_grpo: Divide by the group's standard deviation.
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.
        eps: Added to the std (a group with equal scores then gets 0, not nan).

    Returns:
        ``(advantages, returns)``: the sequence advantage on each of its response
        tokens, both. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    scores, index, num_groups, count = _grouped_scores(token_rewards, response_mask, group_ids)
    advantages = _group_normalised(
        scores, index, num_groups, count, norm_adv_by_std_in_grpo, eps, singleton_groups
    )
    return _outcome(advantages, response_mask)


@register_estimator(
    "rloo",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus the mean score of the other responses to the same prompt",
        'Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE", arXiv:2402.14740',
    ),
)
@torch.no_grad()
def rloo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Tensor,
    singleton_groups: str = "zero",
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out advantages (Ahmadian et al., 2024, arXiv:2402.14740).

    ``A_i = s_i - mean of the other samples in i's group``.

    Args:
        token_rewards: Reward per token; a row's masked sum is its score. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        ``(advantages, returns)``: the sequence advantage on each of its response
        tokens, both. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    scores, index, num_groups, count = _grouped_scores(token_rewards, response_mask, group_ids)
    total = _group_sum(scores, index, num_groups)
    # baseline = mean of the n - 1 other samples (independent of s_i, so unbiased)
    baseline = (total - scores) / (count - 1).clamp(min=1)
    # a singleton has no other sample to form a baseline
    advantages = torch.where(
        count > 1, scores - baseline, _singleton_advantage(scores, singleton_groups)
    )
    return _outcome(advantages, response_mask)


@register_estimator(
    "reinforce_plus_plus",
    needs=(),
    note=AlgorithmNote(
        "discounted returns-to-go of the token rewards, whitened over the batch; no critic",
        'Hu 2025, "REINFORCE++", arXiv:2501.03262',
    ),
)
@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: Tensor, response_mask: Tensor, *, gamma: float
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
    check_2d("token_rewards", token_rewards)
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    check_unit_interval("gamma", gamma)
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


@register_estimator(
    "reinforce_plus_plus_baseline",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus its group's mean, whitened over the batch's response tokens",
        'Hu 2025, "REINFORCE++", arXiv:2501.03262',
    ),
)
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Tensor,
    singleton_groups: str = "zero",
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu, 2025, arXiv:2501.03262; VeRL's
    "reinforce_plus_plus_baseline").

    The group mean is subtracted from each score, the result is spread over the
    response tokens and whitened over all response tokens of the batch (so longer
    responses weigh more in the statistics).

    Args:
        token_rewards: Reward per token; a row's masked sum is its score. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        singleton_groups: What a group of size 1 gets before whitening; see
            :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        ``(advantages, returns)``: the whitened advantages, both, 0 outside the mask.
        Shape: (B, T).

    Raises:
        ValueError: On bad shapes, non-integer ``group_ids`` or < 2 response tokens.
    """
    scores, index, num_groups, count = _grouped_scores(token_rewards, response_mask, group_ids)
    # subtract the prompt's mean score: removes prompt difficulty from the signal
    centred = scores - _group_sum(scores, index, num_groups) / count
    centred = torch.where(count > 1, centred, _singleton_advantage(scores, singleton_groups))
    # batch-wide whitening over tokens, as in REINFORCE++ (Hu, 2025)
    advantages = masked_whiten(_broadcast_over_mask(centred, response_mask), response_mask)
    return advantages, advantages


@register_estimator(
    "opo",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus the response-length-weighted mean score of its group (optimal baseline)",
        'Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585',
    ),
)
@torch.no_grad()
def opo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Tensor,
    singleton_groups: str = "zero",
) -> tuple[Tensor, Tensor]:
    """OPO advantages (Hao et al., 2025, "On-Policy RL with Optimal Reward Baseline",
    arXiv:2505.23585): score minus the length-weighted mean score of its group.

    ``b_g = Σ_j |y_j|·s_j / Σ_j |y_j|`` over the group's samples, ``A_i = s_i - b_g``,
    with |y_j| the number of response tokens of sample j. For sequence-level rewards
    this is the baseline that minimises the gradient variance when a sequence's
    gradient norm grows with its length (the paper's derivation). A group whose
    samples have no response token at all gets baseline 0 (its rows carry no token).

    Args:
        token_rewards: Reward per token; a row's masked sum is its score. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        ``(advantages, returns)``: the sequence advantage on each of its response
        tokens, both. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    scores, index, num_groups, count = _grouped_scores(token_rewards, response_mask, group_ids)
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
    return _outcome(advantages, response_mask)


@register_estimator(
    "gpg",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus its group's mean, scaled by B/(B-M) (M: samples of all-equal groups); "
        "pair with actor.policy_loss=reinforce",
        'Chu et al. 2025, "GPG: A Simple and Strong RL Baseline for Model Reasoning", '
        "arXiv:2504.02546",
    ),
)
@torch.no_grad()
def gpg_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Tensor,
    singleton_groups: str = "zero",
) -> tuple[Tensor, Tensor]:
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
        token_rewards: Reward per token; a row's masked sum is its score. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.

    Returns:
        ``(advantages, returns)``: the sequence advantage on each of its response
        tokens, both. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    scores, index, num_groups, count = _grouped_scores(token_rewards, response_mask, group_ids)
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
    return _outcome(alpha * advantages, response_mask)


@register_estimator(
    "grpo_passk",
    needs=_GROUP,
    note=AlgorithmNote(
        "pass@k: only each group's best response gets a signal, its score minus the "
        "runner-up's, over the group's std",
        'Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using '
        'RL", arXiv:2503.19595',
    ),
)
@torch.no_grad()
def grpo_passk_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    singleton_groups: str = "zero",
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO for pass@k (Tang et al., 2025, "Optimizing Language Models for Inference
    Time Objectives using Reinforcement Learning", arXiv:2503.19595; VeRL's "grpo_passk").

    A group of k samples counts as solved when its best sample is: only that sample
    gets a signal, ``A_best = (s_max - s_second) / (std_g + eps)`` (without the std
    when ``norm_adv_by_std_in_grpo`` is False); the others get 0. With tied best scores the
    earliest row is the best one, and its advantage is 0.

    Args:
        token_rewards: Reward per token; a row's masked sum is its score. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        norm_adv_by_std_in_grpo: Divide by the group's (unbiased) standard deviation.
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.
        eps: Added to the std.

    Returns:
        ``(advantages, returns)``: the sequence advantage on each of its response
        tokens, both. Shape: (B, T).

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    scores, index, num_groups, count = _grouped_scores(token_rewards, response_mask, group_ids)
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
    if norm_adv_by_std_in_grpo:
        centred = scores - _group_sum(scores, index, num_groups) / count
        gap = gap / (_group_std(centred, index, num_groups, count) + eps)
    advantages = torch.where(best, gap, torch.zeros_like(gap))
    advantages = torch.where(count > 1, advantages, _singleton_advantage(scores, singleton_groups))
    return _outcome(advantages, response_mask)


@register_estimator(
    "gdpo",
    needs=_GROUP | {"reward_components", "component_weights"},
    note=AlgorithmNote(
        "each reward kind (the reward service's scores_<kind>) normalised within its "
        "group, weighted sum, whitened over the batch",
        'Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy '
        'Optimization", arXiv:2601.05242',
    ),
)
@torch.no_grad()
def gdpo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    reward_components: Tensor,
    component_weights: Tensor,
    group_ids: Tensor,
    singleton_groups: str = "zero",
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GDPO: normalise each reward component within its group, then combine (Liu et
    al., 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization", arXiv:2601.05242).

    Summing K rewards before GRPO's normalisation lets distinct combinations collapse to
    one advantage (e.g. (1, 0) and (0, 1) in a group); GDPO keeps them apart::

        A_k = GRPO advantage of component k within its group   (mean/std per group)
        A   = whiten(Σ_k w_k·A_k)                              (over the batch's tokens)

    Args:
        token_rewards: Not read: the token rewards' KL penalty is no reward kind, GDPO
            reads the kinds' scores. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        reward_components: One column per reward component (the reward service's
            ``scores_<kind>``). Shape: (B, K).
        component_weights: Weight of each component. Shape: (K,).
        group_ids: Prompt group of each sequence (any integers). Shape: (B,).
        singleton_groups: What a group of size 1 gets per component before the
            combination; see :data:`SINGLETON_GROUP_CHOICES`.
        eps: Added to each group std.

    Returns:
        ``(advantages, returns)``: the whitened advantages, both, 0 outside the mask.
        Shape: (B, T).

    Raises:
        ValueError: On bad shapes, non-integer ``group_ids`` or < 2 response tokens.
    """
    del token_rewards
    check_2d("reward_components", reward_components)
    if component_weights.shape != (reward_components.shape[1],):
        raise ValueError(
            f"component_weights must have shape ({reward_components.shape[1]},), one per "
            f"column of reward_components; got {tuple(component_weights.shape)}"
        )
    index, num_groups = _groups(group_ids, response_mask)
    if reward_components.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"reward_components has {reward_components.shape[0]} rows but response_mask "
            f"has {response_mask.shape[0]}; they must be equal"
        )
    components = _outcome_scores(reward_components)
    count = _group_sum(components.new_ones(components.shape[0]), index, num_groups)
    combined = torch.zeros_like(response_mask, dtype=components.dtype)
    for k in range(components.shape[1]):
        per_kind = _group_normalised(
            components[:, k], index, num_groups, count, True, eps, singleton_groups
        )
        weight = component_weights[k].to(components.dtype)
        combined = combined + weight * _broadcast_over_mask(per_kind, response_mask)
    # batch-level whitening: the combined advantage's scale no longer grows with K
    advantages = masked_whiten(combined, response_mask)
    return advantages, advantages


def _returns_to_go(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Undiscounted sum of the token rewards from each response token on (tokens
    outside the mask are skipped). Shape: (B, T), 0 outside the mask."""
    mask = response_mask.bool()
    rewards = torch.where(mask, token_rewards, torch.zeros_like(token_rewards))
    returns = rewards.flip(dims=[1]).cumsum(dim=1).flip(dims=[1])
    return torch.where(mask, returns, torch.zeros_like(returns))


@register_estimator(
    "remax",
    needs={"baseline_scores"},
    note=AlgorithmNote(
        "return-to-go minus the score of the greedy response to the same prompt (one "
        "extra greedy generation and reward call per prompt)",
        'Li et al. 2024, "ReMax: A Simple, Effective, and Efficient RL Method", arXiv:2310.10505',
    ),
)
@torch.no_grad()
def remax_advantages(
    token_rewards: Tensor, response_mask: Tensor, *, baseline_scores: Tensor
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
        response_mask: 1 for response tokens. Shape: (B, T).
        baseline_scores: Score of the greedy response to each row's prompt. Shape: (B,).

    Returns:
        ``(advantages, returns)``, both Shape: (B, T), 0 outside the mask.

    Raises:
        ValueError: On bad shapes.
    """
    check_2d("token_rewards", token_rewards)
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    if baseline_scores.shape != (token_rewards.shape[0],):
        raise ValueError(
            f"baseline_scores must have shape ({token_rewards.shape[0]},), one per row; "
            f"got {tuple(baseline_scores.shape)}"
        )
    returns = _returns_to_go(token_rewards, response_mask)
    baseline = _broadcast_over_mask(baseline_scores.to(returns.dtype), response_mask)
    return returns - baseline, returns


@register_estimator(
    "optimal_token_baseline",
    needs=_GROUP | {"old_log_probs", "sum_pi_squared"},
    note=AlgorithmNote(
        "return-to-go minus a per-group, per-position baseline weighted by each path's "
        "accumulated gradient variance (1 - 2π + Σπ²; asks the rollout for Σπ²)",
        'Greensmith et al. 2004, "Variance Reduction Techniques for Gradient Estimates '
        'in RL", JMLR 5; VeRL\'s "optimal_token_baseline"',
    ),
)
@torch.no_grad()
def optimal_token_baseline_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Tensor,
    old_log_probs: Tensor,
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
        old_log_probs: log π_old of the sampled tokens. Shape: (B, T).
        sum_pi_squared: Σ_v π_old(v)² at each position. Shape: (B, T).
        token_weights: Importance weights of the tokens, or None. Shape: (B, T).
        singleton_groups: What a group of size 1 gets; see :data:`SINGLETON_GROUP_CHOICES`.
        eps: Added to the weight sum.

    Returns:
        ``(advantages, returns)``, both Shape: (B, T), 0 outside the mask.

    Raises:
        ValueError: On bad shapes or non-integer ``group_ids``.
    """
    check_2d("token_rewards", token_rewards)
    check_same_shape(
        token_rewards=token_rewards,
        response_mask=response_mask,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
    )
    index, num_groups = _groups(group_ids, response_mask)
    mask = response_mask.bool()
    old_log_probs, sum_pi_squared = inside_mask(mask, old_log_probs, sum_pi_squared)
    returns = _returns_to_go(token_rewards, mask)
    variance = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if token_weights is not None:
        check_same_shape(token_weights=token_weights, response_mask=response_mask)
        variance = variance * torch.where(mask, token_weights, torch.zeros_like(token_weights)) ** 2
    path_variance = torch.where(mask, variance, torch.zeros_like(variance)).cumsum(dim=1)
    path_variance = torch.where(mask, path_variance, torch.zeros_like(path_variance))
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
