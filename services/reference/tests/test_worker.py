"""ReferenceWorker and ReferenceController in-process: exact log-probs, frozen weights."""

import asyncio
import time

import grpc
import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.modeling import load_causal_lm
from rlserve.core.rank_worker import RankSetup
from rlserve.core.serving import Deadline, RpcError
from rlserve.reference.config import ReferenceServiceConfig
from rlserve.reference.controller import controller_for, worker_kwargs
from rlserve.reference.worker import ReferenceWorker


def make_worker(model_dir, forward_micro_batch_samples=3):
    return ReferenceWorker(
        rank=0,
        world_size=1,
        setup=RankSetup(str(model_dir)),
        forward_micro_batch_samples=forward_micro_batch_samples,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_a_direct_model_computation(
    tiny_model_dir, make_batch, direct_reference, temperature
):
    batch = make_batch(6, seed=1)
    worker = make_worker(tiny_model_dir)
    log_probs = worker.compute_ref_log_prob(batch, temperature).tensors["ref_log_probs"]
    assert log_probs.shape == (6, 5) and log_probs.dtype == torch.float32
    mask = batch.tensors["response_mask"]
    assert torch.all(log_probs[mask == 0] == 0) and torch.all(log_probs[mask == 1] < 0)
    expected = direct_reference(load_causal_lm(tiny_model_dir), batch, temperature)
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=0)


def test_micro_batching_does_not_change_log_probs(tiny_model_dir, make_batch):
    batch = make_batch(7, seed=2)
    one = make_worker(tiny_model_dir, forward_micro_batch_samples=1).compute_ref_log_prob(batch)
    all_rows = make_worker(tiny_model_dir, forward_micro_batch_samples=7).compute_ref_log_prob(
        batch
    )
    torch.testing.assert_close(
        one.tensors["ref_log_probs"], all_rows.tensors["ref_log_probs"], atol=1e-5, rtol=0
    )


def test_weights_are_frozen(tiny_model_dir, make_batch):
    worker = make_worker(tiny_model_dir)
    assert not worker.model.training
    assert not any(p.requires_grad for p in worker.model.parameters())
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    first = worker.compute_ref_log_prob(make_batch(4))
    second = worker.compute_ref_log_prob(make_batch(4))
    assert torch.equal(first.tensors["ref_log_probs"], second.tensors["ref_log_probs"])
    assert all(torch.equal(before[k], v) for k, v in worker.model.state_dict().items())


def test_controller_checks_requests(tiny_model_dir, make_batch, in_process_group):
    config = ReferenceServiceConfig(
        model_path=str(tiny_model_dir), max_batch_samples=8, max_request_tokens=50
    )
    worker = ReferenceWorker(rank=0, world_size=1, **worker_kwargs(config))
    controller = controller_for(config, in_process_group([worker]))
    good = make_batch(4)
    t = good.tensors
    cases = [
        (Batch(), grpc.StatusCode.INVALID_ARGUMENT, "batch: empty batch"),
        (make_batch(9), grpc.StatusCode.RESOURCE_EXHAUSTED, "batch: 9 rows exceed"),
        (
            make_batch(5),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "batch.tensors['input_ids']: 5 rows × 11 = 55 token positions exceed this "
            "service's limit of 50 (its max_request_tokens setting)",
        ),
        (
            Batch({**t, "response_mask": t["response_mask"][:, :2]}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "batch.tensors['response_mask']: shape [4, 2] must match responses [4, 5]",
        ),
        (
            Batch({**t, "attention_mask": torch.zeros_like(t["attention_mask"])}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "batch.tensors['response_mask']: marks positions that attention_mask",
        ),
    ]
    for batch, code, message in cases:
        with pytest.raises(RpcError) as error:
            asyncio.run(controller.compute_ref_log_prob(batch))
        assert error.value.code == code and message in error.value.message, error.value.message
    with pytest.raises(RpcError) as error:
        asyncio.run(controller.compute_ref_log_prob(good, Deadline(unix_s=1.0)))
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    bad_meta = Batch(t, meta={"temperature": "hot"})
    with pytest.raises(RpcError, match=r"batch.meta\['temperature'\]: must be a finite number"):
        asyncio.run(controller.compute_ref_log_prob(bad_meta))
    result, metrics = asyncio.run(controller.compute_ref_log_prob(good))
    assert result.tensors["ref_log_probs"].shape == (4, 5)
    assert metrics["tokens"] == float(t["response_mask"].sum())


def test_log_probs_stop_at_the_deadline_between_micro_batches_and_the_worker_serves_on(
    tiny_model_dir, make_batch, in_process_group
):
    """Issue 12 defect 7: a ComputeRefLogProb whose caller had given up ran on in the
    workers, and later calls queued behind it. The workers now stop at the next
    micro-batch."""
    config = ReferenceServiceConfig(model_path=str(tiny_model_dir), forward_micro_batch_samples=1)
    worker = ReferenceWorker(rank=0, world_size=1, **worker_kwargs(config))
    # In-process, the call blocks the event loop: only the worker itself can stop it.
    controller = controller_for(config, in_process_group([worker]))
    batch = make_batch(1024, seed=4)  # 1024 forward passes: ≈ 2 s
    asyncio.run(controller.worker_infos())
    started = time.perf_counter()
    asyncio.run(controller.compute_ref_log_prob(batch))
    full_s = time.perf_counter() - started
    started = time.perf_counter()
    with pytest.raises(RpcError) as error:
        asyncio.run(
            controller.compute_ref_log_prob(batch, Deadline(unix_s=time.time() + full_s / 10))
        )
    stopped_s = time.perf_counter() - started
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, error.value.message
    assert stopped_s < full_s / 2, (stopped_s, full_s)
    result, _ = asyncio.run(controller.compute_ref_log_prob(batch.index(slice(0, 2))))
    assert result.tensors["ref_log_probs"].shape == (2, 5)


def test_the_batch_sampling_temperature_wins_over_the_configured_one(
    tiny_model_dir, make_batch, in_process_group
):
    config = ReferenceServiceConfig(model_path=str(tiny_model_dir), temperature=0.5)
    worker = ReferenceWorker(rank=0, world_size=1, **worker_kwargs(config))
    controller = controller_for(config, in_process_group([worker]))
    batch = make_batch(3, seed=4)

    def scored(meta):
        result, metrics = asyncio.run(
            controller.compute_ref_log_prob(Batch(batch.tensors, meta=meta))
        )
        return result.tensors["ref_log_probs"], metrics["temperature"]

    configured, temperature = scored({})
    assert temperature == 0.5
    assert torch.equal(configured, worker.compute_ref_log_prob(batch, 0.5).tensors["ref_log_probs"])
    stamped, temperature = scored({"temperature": 0.8})
    assert temperature == 0.8
    assert torch.equal(stamped, worker.compute_ref_log_prob(batch, 0.8).tensors["ref_log_probs"])
    assert scored({"temperature": 0.0})[1] == 1.0  # greedy sampling scores at T = 1
