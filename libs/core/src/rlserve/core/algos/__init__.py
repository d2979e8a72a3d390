"""PPO math for language models, as pure functions, one module per purpose.

Everything the trainer and the actor/critic services compute *about* a batch lives
here:

- ``notes``: the one-line note and paper of every registered name, and the registry
  that advantage estimators and policy losses are registered in.
- ``masked``: shape checks, guards against padding garbage and overflow, masked
  statistics.
- ``kl``: KL estimators and the KL-in-reward penalty, KL-coefficient controllers, the
  KL loss.
- ``advantages``: advantage estimators (GAE, GRPO, RLOO, REINFORCE++, OPO, GPG, GRPO
  pass@k, GDPO, ReMax, optimal token baseline); ``advantage_registry``: them by config
  name, with the inputs each needs and reads.
- ``rollout_correction``: truncated importance weights against the rollout engine's
  log-probs.
- ``aggregation``: entropy, loss aggregation and its mini-batch normalisation.
- ``policy_losses`` (PPO clip, GSPO, CISPO, GMPO, REINFORCE, SAPO), ``covariance_losses``
  (Clip-Cov, KL-Cov) and ``dppo_losses`` (DPPO-TV, DPPO-KL); ``policy_loss_registry``:
  them by config name, with their knobs and default clip ranges.
- ``value``: the clipped value loss.
- ``dapo``: DAPO's overlong penalty and overlong filtering.

The run config chooses advantage estimators, policy losses, KL estimators and loss
aggregation modes by name from the registries; each name has an
:class:`~rlserve.core.algos.notes.AlgorithmNote` (one line and its paper), which
``rlserve config --describe`` prints under the field that selects it.

Notation::

    B            batch of sequences (one prompt + one sampled response per row)
    T            padded response length
    V            vocabulary size
    G            number of prompt groups (samples of the same prompt share a group id)
    response_mask  (B, T), 1 for response tokens, 0 elsewhere; bool, int or float.
                   May hold left padding, right padding or gaps (e.g. tool output
                   inside a multi-turn response).
    log_probs      (B, T) log π_θ(token | prefix) in nats, current policy (with grad)
    old_log_probs  (B, T) the same under the policy that generated the batch
    ref_log_probs  (B, T) the same under the frozen reference policy
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
  :func:`aggregation.aggregate_loss`).
"""

# The advantage estimators and the policy losses register themselves where they are
# defined; importing their modules here fills the registries before anything reads them.
from rlserve.core.algos import (  # noqa: F401
    advantages,
    covariance_losses,
    dppo_losses,
    policy_losses,
)
