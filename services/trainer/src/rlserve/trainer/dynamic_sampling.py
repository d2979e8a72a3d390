"""DAPO's dynamic sampling: a step trains only on prompt groups whose scores differ.

A group whose responses all got the same score has zero advantage under every group
estimator: it costs forwards and an update and teaches nothing, and as the policy
improves more groups become all-right. With `algorithm.dynamic_sampling` the trainer
scores each generation round first, keeps the groups whose scores differ, and generates
another round from the next prompts until it holds `trainer.prompts_per_step` groups or
has run `algorithm.dynamic_sampling_max_rounds` rounds; it then trains on the first
prompts_per_step groups kept (fewer when the rounds ran out; the metrics say so). An
extra round costs a generation and a reward call; the forwards and updates see only the
kept rows. (Yu et al. 2025, "DAPO", arXiv:2503.14476, section 3.2.)
"""

from collections.abc import Awaitable, Callable, Sequence

import torch

from rlserve.core.batch import Batch


class NoInformativeGroups(RuntimeError):
    """Dynamic sampling found no prompt group with differing scores in any round."""


async def informative_batch(
    step: int,
    generate_round: Callable[[int], Awaitable[tuple[int, Batch, dict[str, float]]]],
    rewards: Callable[[Batch], Awaitable[dict[str, torch.Tensor]]],
    wanted: int,
    max_rounds: int,
    mini_batch: int,
    pad_token_id: int,
) -> tuple[Batch, dict[str, float]]:
    """Generation rounds until `wanted` groups with differing scores are kept (at most
    `max_rounds`); the batch carries its rewards, and the metrics are the last round's
    generation metrics plus dynamic_sampling/*.

    `generate_round(round_index)` draws the round's prompts and generates their
    responses: (prompt groups, batch, generation metrics); `rewards(batch)` scores them
    (rlserve.trainer.rewards.Rewards.rewards).

    Raises:
        NoInformativeGroups: the rounds kept fewer groups than one mini-batch of
            `mini_batch` prompts.
    """
    kept: list[Batch] = []
    groups = generated_groups = 0
    gen_metrics: dict[str, float] = {}
    for round_index in range(max_rounds):
        round_groups, batch, gen_metrics = await generate_round(round_index)
        scored = await rewards(batch)
        batch = Batch({**batch.tensors, **scored}, batch.non_tensors, batch.meta)
        generated_groups += round_groups
        informative = informative_rows(scored["scores"], batch["uid"])
        if bool(informative.any()):
            kept.append(batch.index(torch.nonzero(informative).squeeze(1).tolist()))
            groups += len(set(kept[-1]["uid"]))
        if groups >= wanted:
            break
    # the actor trains in whole mini-batches: a step short of groups trains on as many
    # whole mini-batches as it has
    trained = min(groups, wanted) // mini_batch * mini_batch
    if trained == 0:
        raise NoInformativeGroups(
            f"step {step + 1}: {groups} of {generated_groups} prompt groups in "
            f"{round_index + 1} rounds got differing scores, fewer than one "
            f"mini-batch (actor.ppo_mini_batch_prompts {mini_batch}); raise "
            "algorithm.dynamic_sampling_max_rounds or turn dynamic_sampling off"
        )
    batch = first_groups(concat_rounds(kept, pad_token_id), trained)
    gen_metrics = {
        **gen_metrics,
        "dynamic_sampling/rounds": float(round_index + 1),
        "dynamic_sampling/groups": float(trained),
        "dynamic_sampling/kept_fraction": groups / generated_groups,
    }
    return batch, gen_metrics


def informative_rows(scores: torch.Tensor, uids: Sequence[int]) -> torch.Tensor:
    """True for each row whose group (same uid) holds at least two different scores.
    Shape: scores (B,) -> (B,) bool."""
    group_index = {uid: index for index, uid in enumerate(dict.fromkeys(uids))}
    index = torch.tensor([group_index[uid] for uid in uids], dtype=torch.int64)
    groups = len(group_index)
    values = scores.float()
    low = torch.full((groups,), float("inf")).scatter_reduce(0, index, values, "amin")
    high = torch.full((groups,), float("-inf")).scatter_reduce(0, index, values, "amax")
    return (high > low)[index]


def _left_pad(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    padding = torch.full((tensor.shape[0], missing), value, dtype=tensor.dtype)
    return torch.cat([padding, tensor], dim=1)


def concat_rounds(rounds: Sequence[Batch], pad_token_id: int) -> Batch:
    """The rows of several generation rounds as one batch: prompt ‖ response tensors
    (the width of input_ids) left-padded to the widest round (prompts are left-padded,
    so their lengths may differ between rounds; responses share the generation cap), and
    uids renumbered so that groups of different rounds stay apart."""
    width = max(batch["input_ids"].shape[1] for batch in rounds)
    padded = []
    uid_offset = 0
    for batch in rounds:
        own_width = batch["input_ids"].shape[1]
        tensors = {
            key: _left_pad(tensor, width, pad_token_id if key == "input_ids" else 0)
            if tensor.dim() == 2 and tensor.shape[1] == own_width
            else tensor
            for key, tensor in batch.tensors.items()
        }
        uids = [uid_offset + int(uid) for uid in batch["uid"]]
        uid_offset = max(uids, default=uid_offset - 1) + 1
        padded.append(Batch(tensors, {**batch.non_tensors, "uid": uids}, batch.meta))
    return Batch.concat(padded)


def first_groups(batch: Batch, groups: int) -> Batch:
    """The rows of the first `groups` distinct uids, in batch order."""
    kept = list(dict.fromkeys(batch["uid"]))[:groups]
    wanted = set(kept)
    return batch.index([i for i, uid in enumerate(batch["uid"]) if uid in wanted])
