"""CriticWorker in-process (world size 1, gloo): values, micro-batching, one update."""

import copy

import pytest
import torch

from rlserve.core.algos.value import value_loss
from rlserve.core.cluster import free_port
from rlserve.core.rank_worker import RankSetup
from rlserve.core.training import OptimizerSettings
from rlserve.critic.model import load_value_model, response_values
from rlserve.critic.requests import MiniBatchSlice, RankUpdate, ValueLossSettings, loss_units
from rlserve.critic.worker import CriticWorker

SEQUENCE_KEYS = ["input_ids", "attention_mask", "responses", "response_mask"]


def make_worker(
    model_dir,
    micro_batch_samples=2,
    cliprange_value=0.2,
    loss_agg_mode="token-mean",
    forward_micro_batch_samples=3,
):
    optimizer = OptimizerSettings(
        lr=1e-2,
        weight_decay=0.0,
        zero_stage=0,
        grad_clip=1e6,  # no clipping, so the plain-torch reference below needs none
        micro_batch_samples=micro_batch_samples,
        grad_accum_steps=2,
    )
    worker = CriticWorker(
        rank=0,
        world_size=1,
        setup=RankSetup(str(model_dir)),
        optimizer=optimizer,
        loss=ValueLossSettings(cliprange_value, loss_agg_mode),
        forward_micro_batch_samples=forward_micro_batch_samples,
    )
    worker.init_distributed("127.0.0.1", free_port())
    return worker


def test_initial_values_are_zero(tiny_model_dir, make_batch):
    worker = make_worker(tiny_model_dir)
    batch = make_batch(5)
    values = worker.compute_values(batch.select(SEQUENCE_KEYS)).tensors["values"]
    assert values.shape == (5, 5) and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0


def test_values_read_the_position_before_each_response_token(critic_model_dir, make_batch):
    worker = make_worker(critic_model_dir, forward_micro_batch_samples=2)
    batch = make_batch(5)
    values = worker.compute_values(batch.select(SEQUENCE_KEYS)).tensors["values"]
    mask = batch.tensors["response_mask"]
    assert torch.all(values[mask == 0] == 0)
    assert torch.all(values[mask == 1] != 0)  # the exported head is not zero

    # The obvious version: one full-sequence forward, row by row, no padding of others.
    model = load_value_model(critic_model_dir)
    with torch.no_grad():
        for row in range(5):
            ids = batch.tensors["input_ids"][row : row + 1]
            full = model(ids, batch.tensors["attention_mask"][row : row + 1])[0]
            for t in range(5):
                if mask[row, t]:
                    assert values[row, t] == pytest.approx(float(full[6 + t - 1]), abs=1e-5)


def test_forward_micro_batching_does_not_change_values(critic_model_dir, make_batch):
    batch = make_batch(7).select(SEQUENCE_KEYS)
    one = make_worker(critic_model_dir, forward_micro_batch_samples=1).compute_values(batch)
    all_rows = make_worker(critic_model_dir, forward_micro_batch_samples=7).compute_values(batch)
    torch.testing.assert_close(one.tensors["values"], all_rows.tensors["values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_update_equals_one_full_batch_adamw_step(critic_model_dir, make_batch, loss_agg_mode):
    """2 micro-batches of 2 (DeepSpeed accumulation, loss weighting) = one 4-row step."""
    batch = make_batch(4, seed=3)
    mask = batch.tensors["response_mask"]
    worker = make_worker(critic_model_dir, loss_agg_mode=loss_agg_mode, cliprange_value=0.05)
    order = torch.tensor([2, 0, 3, 1])
    [metrics] = worker.update_critic(
        RankUpdate(batch, [MiniBatchSlice(order, loss_units(mask, loss_agg_mode))])
    )
    after = worker.compute_values(batch.select(SEQUENCE_KEYS)).tensors["values"]

    model = load_value_model(critic_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ids, attention = batch.tensors["input_ids"], batch.tensors["attention_mask"]
    values = response_values(model(ids, attention), mask, 5)
    loss, expected = value_loss(
        values,
        batch.tensors["values"],
        batch.tensors["returns"],
        mask,
        clip_range=0.05,
        loss_agg_mode=loss_agg_mode,
    )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    optimizer.step()
    with torch.no_grad():
        expected_after = response_values(model(ids, attention), mask, 5)

    assert metrics["vf_loss"] == pytest.approx(float(expected["vf_loss"]), rel=1e-5)
    clipfrac = metrics["clipped_tokens"] / metrics["tokens"]
    assert clipfrac == pytest.approx(float(expected["vf_clipfrac"]), abs=1e-6)
    assert 0 < clipfrac < 1  # the clip is exercised, not vacuous
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert metrics["lr"] == pytest.approx(1e-2)
    torch.testing.assert_close(after, expected_after, atol=1e-5, rtol=1e-4)


def test_updates_reduce_the_value_loss_on_a_fixed_batch(tiny_model_dir, make_batch):
    batch = make_batch(8, seed=5)
    mask = batch.tensors["response_mask"]
    worker = make_worker(tiny_model_dir, micro_batch_samples=4, cliprange_value=10.0)
    mini = MiniBatchSlice(torch.arange(8), loss_units(mask, "token-mean"))
    losses = [worker.update_critic(RankUpdate(batch, [mini]))[0]["vf_loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]


def test_a_micro_batch_without_response_tokens_trains_nothing_from_it(critic_model_dir, make_batch):
    batch = make_batch(4, seed=3)
    mask = batch.tensors["response_mask"].clone()
    mask[1] = 0
    mask[3] = 0
    batch = copy.copy(batch)
    batch.tensors = {**batch.tensors, "response_mask": mask}
    worker = make_worker(critic_model_dir)
    # rows 1 and 3 form the second micro-batch: zero units there, a zero backward
    [metrics] = worker.update_critic(
        RankUpdate(batch, [MiniBatchSlice(torch.tensor([0, 2, 1, 3]), int(mask.sum()))])
    )
    assert metrics["tokens"] == float(mask.sum())
    assert metrics["vf_loss"] > 0 and metrics["grad_norm"] > 0
