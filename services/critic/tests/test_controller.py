"""CriticController without Ray: checks, idempotent updates by step, versions, deadlines.

The controller drives real CriticWorkers here (world size 1, in this process) through
the WorkerGroup interface; only Ray's actor transport is left out.
"""

import asyncio
import time

import grpc
import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.config import ConfigError, validate_config
from rlserve.core.serving import Deadline, RpcError
from rlserve.core.training import weights_only_load
from rlserve.critic.config import CriticServiceConfig
from rlserve.critic.controller import controller_for, worker_kwargs
from rlserve.critic.worker import CriticWorker

SEQUENCE_KEYS = ["input_ids", "attention_mask", "responses", "response_mask"]


def joined_worker(config: CriticServiceConfig) -> CriticWorker:
    """Rank 0 of a one-worker process group, built from `config`."""
    from rlserve.core.cluster import free_port

    worker = CriticWorker(rank=0, world_size=1, **worker_kwargs(config))
    worker.init_distributed("127.0.0.1", free_port())
    return worker


@pytest.fixture(scope="module")
def controller(critic_model_dir, in_process_group):

    config = CriticServiceConfig(
        model_path=str(critic_model_dir),
        ppo_mini_batch_samples=4,
        micro_batch_samples=2,
        ppo_epochs=2,
        lr=1e-2,
        max_batch_samples=16,
        max_request_tokens=150,
    )
    worker = joined_worker(config)
    return controller_for(config, in_process_group([worker]))


def run(coroutine):
    return asyncio.run(coroutine)


def values_of(controller, batch):
    values, metrics = run(controller.compute_values(batch.select(SEQUENCE_KEYS)))
    return values.tensors["values"], values.meta["weights_version"], metrics


def test_updates_are_idempotent_by_step(controller, make_batch):
    batch = make_batch(8, seed=11)
    before, version, metrics = values_of(controller, batch)
    assert version == 0 and metrics["tokens"] == float(batch.tensors["response_mask"].sum())

    first, version, replayed = run(controller.update_critic(0, batch))
    assert (version, replayed) == (1, False)
    assert first["mini_batches"] == 4  # 8 rows / 4 per mini-batch × 2 epochs
    assert set(first) >= {"vf_loss", "vf_clipfrac", "grad_norm", "lr", "update_s", "tokens"}
    after, version, _ = values_of(controller, batch)
    assert version == 1 and not torch.equal(before, after)

    again, version, replayed = run(controller.update_critic(0, batch))
    assert (again, version, replayed) == (first, 1, True)
    assert torch.equal(values_of(controller, batch)[0], after)  # nothing trained

    _, version, replayed = run(controller.update_critic(1, make_batch(4, seed=12)))
    assert (version, replayed) == (2, False)
    assert run(controller.update_critic(0, batch))[1:] == (1, True)  # still replayable
    # step 1 again with another batch (a second trainer's): refused, nothing trained
    trained = values_of(controller, batch)[0]
    with pytest.raises(RpcError) as refused:
        run(controller.update_critic(1, make_batch(4, seed=13)))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "step: 1 was already applied with another batch" in refused.value.message
    assert torch.equal(values_of(controller, batch)[0], trained)


def test_reset_returns_to_the_initial_values_with_a_fresh_optimizer(
    critic_model_dir, in_process_group, make_batch
):
    config = CriticServiceConfig(
        model_path=str(critic_model_dir), ppo_mini_batch_samples=4, micro_batch_samples=2
    )
    controller = controller_for(config, in_process_group([joined_worker(config)]))
    batch = make_batch(8, seed=3)
    initial = values_of(controller, batch)[0]
    first, _, _ = run(controller.update_critic(0, batch))
    after_first = values_of(controller, batch)[0]
    run(controller.update_critic(1, make_batch(4, seed=4)))

    assert run(controller.reset()) == (0, -1)
    values, version, _ = values_of(controller, batch)
    assert version == 0 and torch.equal(values, initial)
    again, version, replayed = run(controller.update_critic(0, batch))
    assert (version, replayed) == (1, False)
    assert again["vf_loss"] == first["vf_loss"] and again["grad_norm"] == first["grad_norm"]
    assert torch.equal(values_of(controller, batch)[0], after_first)


def test_steps_that_skip_ahead_are_refused_and_poison_nothing(controller, make_batch):
    """Issue 12 defect 6: step 2^63-1 was applied, and every later real step refused."""
    batch = make_batch(4, seed=14)
    expected, version = controller.last_applied_step + 1, controller.weights_version
    before = values_of(controller, batch)[0]
    for step in (2**63 - 1, expected + 1):
        with pytest.raises(RpcError) as error:
            run(controller.update_critic(step, batch))
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert error.value.message.startswith("step: ")
        assert f"expects step {expected} next" in error.value.message
    assert (controller.last_applied_step, controller.weights_version) == (expected - 1, version)
    assert torch.equal(values_of(controller, batch)[0], before)  # nothing trained
    assert run(controller.update_critic(expected, batch))[1:] == (version + 1, False)


def _with(batch: Batch, **tensors) -> Batch:
    return Batch({**batch.tensors, **tensors}, batch.non_tensors, batch.meta)


def _without(batch: Batch, key: str) -> Batch:
    return Batch({k: v for k, v in batch.tensors.items() if k != key})


def bad_batches(make_batch):
    good = make_batch(4, seed=2)
    t = good.tensors
    nan_returns = t["returns"].clone()
    nan_returns[0, 0] = float("nan")
    wrong_tail = t["responses"].clone()
    wrong_tail[0, 0] = (wrong_tail[0, 0] + 1) % 99
    return {
        "empty": (Batch(), grpc.StatusCode.INVALID_ARGUMENT, "batch: empty batch"),
        "too many rows": (make_batch(20), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit of 16"),
        "too many token positions": (
            make_batch(4, prompt_len=40),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "batch.tensors['input_ids']: 4 rows × 45 = 180 token positions exceed this "
            "service's limit of 150 (its max_request_tokens setting)",
        ),
        "no input_ids": (_without(good, "input_ids"), None, "tensors['input_ids']: missing"),
        "float ids": (_with(good, input_ids=t["input_ids"].float()), None, "['input_ids']"),
        "id out of vocab": (
            _with(good, input_ids=t["input_ids"] + 200),
            None,
            "tensors['input_ids']: token ids must lie in 0..98",
        ),
        "mask shape": (
            _with(good, attention_mask=t["attention_mask"][:, 1:]),
            None,
            "tensors['attention_mask']: shape",
        ),
        "mask values": (
            _with(good, response_mask=t["response_mask"] * 2),
            None,
            "tensors['response_mask']: must hold only 0 and 1",
        ),
        "responses not the tail": (
            _with(good, responses=wrong_tail),
            None,
            "tensors['responses']: must equal the last R columns",
        ),
        "no prompt position": (
            _with(good, input_ids=t["responses"], attention_mask=t["response_mask"]),
            None,
            "tensors['input_ids']: needs more positions",
        ),
    }, {
        "nan returns": (_with(good, returns=nan_returns), None, "['returns']: 1 values are NaN"),
        "no values": (_without(good, "values"), None, "tensors['values']: missing"),
        "values shape": (
            _with(good, values=t["values"][:, :2]),
            None,
            "tensors['values']: shape [4, 2] must match responses [4, 5]",
        ),
        "rows not whole mini-batches": (
            make_batch(6),
            None,
            "batch: 6 rows are not a multiple of this critic's ppo_mini_batch_samples (4)",
        ),
        "no response token": (
            _with(good, response_mask=torch.zeros_like(t["response_mask"])),
            None,
            "tensors['response_mask']: has no response token",
        ),
    }


def test_invalid_requests_name_the_field_and_train_nothing(controller, make_batch):
    for_values, for_updates = bad_batches(make_batch)
    cases = [(controller.compute_values, b, c, m) for b, c, m in for_values.values()]
    cases += [
        (lambda b: controller.update_critic(controller.last_applied_step + 1, b), b, c, m)
        for b, c, m in {**for_values, **for_updates}.values()
    ]
    version = controller.weights_version
    for call, batch, code, message in cases:
        with pytest.raises(RpcError) as error:
            run(call(batch))
        assert error.value.code == (code or grpc.StatusCode.INVALID_ARGUMENT), error.value.message
        assert message in error.value.message
    assert controller.weights_version == version
    with pytest.raises(RpcError, match="step: must be >= 0"):
        run(controller.update_critic(-1, make_batch(4)))
    step = controller.last_applied_step + 1
    assert run(controller.update_critic(step, make_batch(4)))[1:] == (version + 1, False)


def test_a_passed_deadline_is_deadline_exceeded(controller, make_batch):
    past = Deadline(unix_s=1.0)
    with pytest.raises(RpcError) as error:
        run(controller.compute_values(make_batch(4).select(SEQUENCE_KEYS), past))
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(RpcError) as error:
        run(controller.update_critic(controller.last_applied_step + 1, make_batch(4), past))
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert controller.last_applied_step + 1 not in controller.steps.results()


def test_values_stop_at_the_deadline_between_micro_batches_and_the_worker_serves_on(
    critic_model_dir, in_process_group, make_batch
):
    """Issue 12 defect 7: ComputeValues whose caller had given up ran on in the workers,
    and later calls queued behind it. The workers now stop at the next micro-batch."""

    config = CriticServiceConfig(
        model_path=str(critic_model_dir),
        ppo_mini_batch_samples=4,
        micro_batch_samples=2,
        forward_micro_batch_samples=1,
    )
    worker = joined_worker(config)
    # Not threaded: the call blocks the event loop, so only the worker itself can stop it.
    controller = controller_for(config, in_process_group([worker]))
    batch = make_batch(1024, seed=4).select(SEQUENCE_KEYS)  # 1024 forward passes: ≈ 2 s
    run(controller.worker_infos())
    started = time.perf_counter()
    run(controller.compute_values(batch))
    full_s = time.perf_counter() - started
    started = time.perf_counter()
    with pytest.raises(RpcError) as error:
        run(controller.compute_values(batch, Deadline(unix_s=time.time() + full_s / 10)))
    stopped_s = time.perf_counter() - started
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, error.value.message
    assert stopped_s < full_s / 2, (stopped_s, full_s)
    values, _ = run(controller.compute_values(batch.index(slice(0, 2))))
    assert values.tensors["values"].shape == (2, 5)


def test_an_update_outlives_its_callers_deadline_and_a_retry_replays_it(
    critic_model_dir, in_process_group, make_batch
):

    config = CriticServiceConfig(
        model_path=str(critic_model_dir),
        ppo_mini_batch_samples=4,
        micro_batch_samples=1,
        ppo_epochs=4,
    )
    worker = joined_worker(config)
    controller = controller_for(config, in_process_group([worker], threaded=True))
    batch = make_batch(64, seed=13)  # 256 forward/backward passes: ≈ 1.5 s, over 0.3 s
    run(controller.worker_infos())  # asked once; not part of the timed call

    async def impatient_then_retry():
        with pytest.raises(RpcError) as error:
            await controller.update_critic(0, batch, Deadline(unix_s=time.time() + 0.3))
        assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "continues and will complete" in error.value.message
        assert controller.weights_version == 0  # still training
        return await controller.update_critic(0, batch)  # waits for it, then replays

    _, version, replayed = run(impatient_then_retry())
    assert (version, replayed) == (1, True)
    assert controller.last_applied_step == 0


def test_config_errors_name_the_field(tiny_model_dir):
    with pytest.raises(ConfigError) as error:
        validate_config(
            CriticServiceConfig,
            {"model_path": "m", "workers": 3, "ppo_mini_batch_samples": 8},
        )
    assert error.value.paths == ("workers",)
    with pytest.raises(ConfigError) as error:
        validate_config(
            CriticServiceConfig,
            {
                "model_path": "m",
                "workers": 2,
                "ppo_mini_batch_samples": 8,
                "micro_batch_samples": 3,
            },
        )
    assert error.value.paths == ("micro_batch_samples",)
    with pytest.raises(ConfigError, match="lrate"):
        validate_config(CriticServiceConfig, {"model_path": "m", "lrate": 1.0})
    with pytest.raises(ConfigError, match="model_path"):
        validate_config(CriticServiceConfig, {})
    config = CriticServiceConfig(model_path="m", workers=2, ppo_mini_batch_samples=8)
    assert (config.worker_mini_batch_samples, config.grad_accum_steps) == (4, 1)


class _Payload:
    """Unpickling this runs code: it writes `marker` (what a crafted checkpoint did)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def test_checkpoints_stay_under_the_root_and_bad_ones_keep_the_weights(
    critic_model_dir, in_process_group, make_batch, tmp_path
):
    """Issue 12 defects 2-4: SaveCheckpoint wrote to any absolute path; a bad checkpoint
    left the critic with unknown weights; LoadCheckpoint unpickled a crafted file."""

    root = tmp_path / "root"
    config = CriticServiceConfig(
        model_path=str(critic_model_dir),
        ppo_mini_batch_samples=4,
        micro_batch_samples=2,
        checkpoint_root=str(root),
    )
    worker = joined_worker(config)
    controller = controller_for(config, in_process_group([worker]))
    for name in (str(tmp_path / "outside"), "../outside", "a\x00b"):
        for call in (controller.save_checkpoint, controller.load_checkpoint):
            with pytest.raises(RpcError) as error:
                run(call(name))
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT, error.value.message
            assert error.value.message.startswith("location.path: ")
    assert not (tmp_path / "outside").exists()
    root.mkdir()
    (root / "a_file").write_text("x")
    with pytest.raises(RpcError) as error:
        run(controller.save_checkpoint("a_file/below"))
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{root / 'a_file'} is a file" in error.value.message

    run(controller.update_critic(0, make_batch(4)))
    assert run(controller.save_checkpoint("good")) == (1, 0)
    # Trained past the checkpoint, so a load that went through would change the values.
    run(controller.update_critic(1, make_batch(4, seed=5)))
    batch = make_batch(4, seed=3)
    values = values_of(controller, batch)[0]
    model_states = root / "good" / "deepspeed" / "state" / "mp_rank_00_model_states.pt"
    marker = tmp_path / "marker"
    states = weights_only_load(model_states)
    # a pickle payload, and weights that load beside a client state that cannot be
    # restored: both refused before the weights change
    for content in ({"module": _Payload(marker)}, {**states, "weights_version": [1, 2]}):
        torch.save(content, model_states)
        with pytest.raises(RpcError) as error:
            run(controller.load_checkpoint("good"))
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "keeps its current weights" in error.value.message
    assert not marker.exists()
    assert torch.equal(values_of(controller, batch)[0], values)
    assert run(controller.update_critic(2, make_batch(4)))[1:] == (3, False)


def test_an_update_that_fails_part_way_leaves_the_critic_refusing_until_a_load(
    critic_model_dir, in_process_group, make_batch, tmp_path
):
    """A rank that fails mid-update may leave the ranks' weights apart: the critic says
    so (FAILED_PRECONDITION, and its health check fails so Serve replaces it) instead of
    serving unknown weights; a LoadCheckpoint makes it usable again."""

    class FailingAfterTheUpdate(in_process_group):
        fail_updates = False

        async def run_each(self, method, per_rank, **kwargs):
            results = await super().run_each(method, per_rank, **kwargs)
            if method == "update_critic" and self.fail_updates:
                raise RuntimeError("rank 1 lost")  # after rank 0 stepped its optimizer
            return results

    config = CriticServiceConfig(
        model_path=str(critic_model_dir),
        ppo_mini_batch_samples=4,
        micro_batch_samples=2,
        checkpoint_root=str(tmp_path),
    )
    worker = joined_worker(config)
    group = FailingAfterTheUpdate([worker])
    controller = controller_for(config, group)
    run(controller.update_critic(0, make_batch(4)))
    run(controller.save_checkpoint("step0"))
    assert controller.health_problems() == []

    group.fail_updates = True
    with pytest.raises(RuntimeError, match="rank 1 lost"):
        run(controller.update_critic(1, make_batch(4, seed=2)))
    group.fail_updates = False
    assert "UpdateCritic step 1 failed part-way" in controller.health_problems()[0]
    for call in (
        lambda: controller.compute_values(make_batch(4).select(SEQUENCE_KEYS)),
        lambda: controller.update_critic(1, make_batch(4, seed=2)),
        lambda: controller.save_checkpoint("after"),
    ):
        with pytest.raises(RpcError) as error:
            run(call())
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "call LoadCheckpoint" in error.value.message

    assert run(controller.load_checkpoint("step0")) == (1, 0)
    assert controller.health_problems() == []
    assert run(controller.update_critic(1, make_batch(4, seed=2)))[1:] == (2, False)
