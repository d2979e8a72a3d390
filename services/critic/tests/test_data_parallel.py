"""Two critic workers compute and train what one does (through the Serve gRPC port).

Both apps start from an exported critic whose head is not zero, so the values compared
are not trivially 0. The update runs 2 epochs × 2 mini-batches of 4 rows with
micro-batches of 1: one worker accumulates 4 micro-batches per optimizer step, two
workers 2 each and all-reduce, once under ZeRO-1 and once under ZeRO-0 (whose all-reduce
runs in buckets; one worker: ZeRO-0, no reduction).
Tolerances: 1e-5 for values (only float summation order
differs), 1e-4 relative for metrics and values after the update.
"""

import pytest
import torch
from ray import serve

from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.rpc import call_metadata
from rlserve.critic.app import build_app
from rlserve.v1 import common_pb2, critic_pb2, critic_pb2_grpc

# key -> (app, workers, ZeRO stage); key 2 also checks that ZeRO-1's partitioned optimizer
# trains the same.
APPS = {
    1: ("critic-dp1-test", 1, 0),
    2: ("critic-dp2-test", 2, 1),
    "2-zero0": ("critic-dp2-zero0-test", 2, 0),
}
TIMEOUT_S = 120.0
CHECKPOINT_ROOT = None  # set by the stubs fixture
SEQUENCE_KEYS = ["input_ids", "attention_mask", "responses", "response_mask"]


@pytest.fixture(scope="module")
def stubs(serve_cluster, critic_model_dir, tmp_path_factory):
    global CHECKPOINT_ROOT
    # Every tmp_path lies under pytest's base temp dir: the apps' checkpoint root.
    CHECKPOINT_ROOT = tmp_path_factory.getbasetemp().resolve()
    targets = []
    for app, workers, zero_stage in APPS.values():
        args = {
            "model_path": str(critic_model_dir),
            "workers": workers,
            "zero_stage": zero_stage,
            "ppo_mini_batch_samples": 4,
            "micro_batch_samples": 1,
            "forward_micro_batch_samples": 2,
            "ppo_epochs": 2,
            "lr": 1e-2,
            "cliprange_value": 0.1,
            "checkpoint_root": str(CHECKPOINT_ROOT),
        }
        targets.append(serve.RunTarget(build_app(args), name=app, route_prefix=f"/{app}"))
    serve.run_many(targets)  # together: their workers start in parallel
    channel = serve_cluster.channel()
    yield {key: critic_pb2_grpc.CriticServiceStub(channel) for key in APPS}
    channel.close()
    for app, _, _ in APPS.values():
        serve.delete(app)


def metadata(key) -> list[tuple[str, str]]:
    return call_metadata(APPS[key][0])


def values(stubs, key, batch: Batch) -> torch.Tensor:
    response = stubs[key].ComputeValues(
        critic_pb2.ComputeValuesRequest(batch=batch_to_proto(batch.select(SEQUENCE_KEYS))),
        metadata=metadata(key),
        timeout=TIMEOUT_S,
    )
    return batch_from_proto(response.batch).tensors["values"]


def test_two_workers_agree_with_one(stubs, make_batch):
    info = stubs[2].GetInfo(critic_pb2.CriticServiceGetInfoRequest(), metadata=metadata(2)).info
    assert [w.rank for w in info.workers] == [0, 1]
    assert info.workers[0].pid != info.workers[1].pid

    odd = make_batch(5, seed=31)  # 5 rows: the 2-worker split pads one row
    one, two = values(stubs, 1, odd), values(stubs, 2, odd)
    assert torch.count_nonzero(one) > 0
    torch.testing.assert_close(two, one, atol=1e-5, rtol=0)

    batch = make_batch(8, seed=32)
    before = values(stubs, 1, batch)
    metrics = {}
    for key in APPS:
        response = stubs[key].UpdateCritic(
            critic_pb2.UpdateCriticRequest(step=0, batch=batch_to_proto(batch)),
            metadata=metadata(key),
            timeout=TIMEOUT_S,
        )
        assert (response.weights_version, response.replayed) == (1, False)
        metrics[key] = response.metrics
    after_one = values(stubs, 1, batch)
    assert not torch.allclose(after_one, before, atol=1e-3)  # the update moved the values
    assert 0 < metrics[1]["vf_clipfrac"] < 1
    for two in (2, "2-zero0"):
        for name in ("vf_loss", "vf_clipfrac", "grad_norm", "lr", "tokens", "mini_batches"):
            expected = pytest.approx(metrics[1][name], rel=1e-4, abs=1e-7)
            assert metrics[two][name] == expected, (two, name)
        torch.testing.assert_close(values(stubs, two, batch), after_one, atol=1e-4, rtol=1e-4)


def test_two_worker_checkpoint_save_update_load_restores(stubs, make_batch, tmp_path):
    name = str(tmp_path.resolve().relative_to(CHECKPOINT_ROOT))
    location = common_pb2.CheckpointLocation(path=name)
    batch = make_batch(4, seed=33)
    saved_at = stubs[2].SaveCheckpoint(
        critic_pb2.CriticServiceSaveCheckpointRequest(location=location),
        metadata=metadata(2),
        timeout=TIMEOUT_S,
    )
    saved = values(stubs, 2, batch)
    moved = stubs[2].UpdateCritic(
        critic_pb2.UpdateCriticRequest(
            step=saved_at.last_applied_step + 1, batch=batch_to_proto(batch)
        ),
        metadata=metadata(2),
        timeout=TIMEOUT_S,
    )
    assert moved.weights_version == saved_at.weights_version + 1
    assert not torch.equal(values(stubs, 2, batch), saved)
    loaded = stubs[2].LoadCheckpoint(
        critic_pb2.CriticServiceLoadCheckpointRequest(location=location),
        metadata=metadata(2),
        timeout=TIMEOUT_S,
    )
    assert (loaded.weights_version, loaded.last_applied_step) == (
        saved_at.weights_version,
        saved_at.last_applied_step,
    )
    assert torch.equal(values(stubs, 2, batch), saved)
