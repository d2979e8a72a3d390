"""ActorWorker + RolloutController in-process (DeepSpeed world size 1, no Ray, no gRPC)."""

import asyncio
import math
import pickle
import time
from dataclasses import replace

import grpc
import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.cluster import free_port
from rlserve.core.process_group import init_process_group
from rlserve.core.serving import Deadline, RpcError
from rlserve.core.training import weights_only_load
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.rollout.controller import (
    RolloutController,
    controller_settings,
    update_row_plan,
    with_mini_batch_counts,
)
from rlserve.rollout.generation import SamplingSettings
from rlserve.rollout.worker import ActorWorker, actor_worker_kwargs

SAMPLING = SamplingSettings(
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    max_new_tokens=5,
    responses_per_prompt=2,
    seed=11,
    ignore_eos=False,
    return_log_probs=True,
)
SEQUENCE_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")


def prompts_batch() -> Batch:
    """Four left-padded prompts (P = 6) with a non-tensor column."""
    rows = [[1, 21, 15, 22, 33], [1, 23, 23, 15, 24, 24], [1, 40], [1, 50, 51]]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return Batch({"input_ids": ids, "attention_mask": mask}, {"ground_truth": ["a", "b", "c", "d"]})


class Service:
    """A controller over one in-process worker, driven on one event loop."""

    group: type  # the root conftest's in-process group (set by use_in_process_group)

    def __init__(self, model_dir, **overrides):
        defaults = {"ppo_mini_batch_samples": 4, "micro_batch_samples": 2, "lr": 1e-2,
                    "ppo_epochs": 1}  # fmt: skip
        config = RolloutServiceConfig(model_path=str(model_dir), **{**defaults, **overrides})
        self.worker = ActorWorker(rank=0, world_size=1, **actor_worker_kwargs(config))
        self.worker.init_distributed("127.0.0.1", free_port())
        settings = controller_settings(config, **self.worker.model_limits())
        self.controller = RolloutController(self.group([self.worker]), settings)
        self.loop = asyncio.new_event_loop()

    def __getattr__(self, name):
        method = getattr(self.controller, name)
        return lambda *args, **kwargs: self.loop.run_until_complete(method(*args, **kwargs))

    def update_batch(self, advantage: float = 1.0) -> Batch:
        """A generated batch scored under the current weights, with constant advantages."""
        batch, _ = self.generate(prompts_batch(), SAMPLING)
        log_probs, _ = self.compute_log_prob(batch)
        mask = batch["response_mask"].float()
        tensors = {key: batch[key] for key in SEQUENCE_KEYS}
        tensors["old_log_probs"] = log_probs["log_probs"]
        tensors["advantages"] = advantage * mask
        return Batch(tensors, meta=batch.meta)


@pytest.fixture(scope="module", autouse=True)
def use_in_process_group(in_process_group):
    Service.group = in_process_group


@pytest.fixture(scope="module")
def process_group():
    init_process_group(0, 1, "127.0.0.1", free_port())


@pytest.fixture(scope="module")
def service(process_group, tiny_model_dir):
    return Service(tiny_model_dir, kept_update_results=2)


def rpc_error(call) -> RpcError:
    with pytest.raises(RpcError) as error:
        call()
    return error.value


def test_generate_builds_the_batch_layout(service):
    prompts = prompts_batch()
    batch, metrics = service.generate(prompts, SAMPLING)
    n, width = len(prompts) * 2, SAMPLING.max_new_tokens
    assert batch["prompts"].shape == (n, 6)
    assert batch["responses"].shape == batch["response_mask"].shape == (n, width)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (n, 6 + width)
    assert torch.equal(batch["prompts"], prompts["input_ids"].repeat_interleave(2, 0))
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], 1))
    assert torch.equal(batch["attention_mask"][:, 6:], batch["response_mask"])
    assert torch.equal(
        batch["attention_mask"][:, :6], prompts["attention_mask"].repeat_interleave(2, 0)
    )
    # right padding: a response is a prefix of ones, padded with the pad id (0)
    lengths = batch["response_mask"].sum(1)
    assert bool((lengths >= 1).all())
    assert torch.equal(batch["response_mask"], (torch.arange(width) < lengths[:, None]).long())
    assert bool((batch["responses"][batch["response_mask"] == 0] == 0).all())
    assert bool((batch["rollout_log_probs"][batch["response_mask"] == 0] == 0).all())
    assert batch["uid"] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch["ground_truth"] == ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert len(batch["response_text"]) == n
    assert batch.meta["weights_version"] == service.controller.weights_version
    assert metrics["generated_tokens"] == float(lengths.sum())
    again, _ = service.generate(prompts, SAMPLING)  # seeded: reproducible
    assert torch.equal(again["responses"], batch["responses"])


def test_rollout_log_probs_equal_compute_log_prob(service):
    batch, _ = service.generate(prompts_batch(), SAMPLING)
    scored, metrics = service.compute_log_prob(batch, return_entropy=True)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(scored["log_probs"], batch["rollout_log_probs"], atol=1e-4, rtol=0)
    assert bool((scored["log_probs"][~mask] == 0).all())
    entropy = scored["entropy"]
    vocab = service.controller.settings.vocab_size
    assert bool((entropy[mask] > 0).all()) and bool((entropy[mask] <= math.log(vocab)).all())
    assert bool((entropy[~mask] == 0).all())
    assert metrics["tokens"] == float(mask.sum())
    # temperature travels in meta: scoring at T = 0.5 matches sampling at T = 0.5
    hot = replace(SAMPLING, temperature=0.5)
    batch, _ = service.generate(prompts_batch(), hot)
    assert batch.meta["temperature"] == 0.5
    scored, _ = service.compute_log_prob(batch)
    torch.testing.assert_close(scored["log_probs"], batch["rollout_log_probs"], atol=1e-4, rtol=0)
    # without the stamp, the configured default (1.0) applies: clearly other numbers
    unstamped, _ = service.compute_log_prob(Batch(batch.tensors))
    assert (unstamped["log_probs"] - scored["log_probs"]).abs().max() > 1e-2


def expiring_after(checks: int):
    """Deadline.remaining_s that leaves time for `checks` calls, then none: a deadline
    that passes at a known point of the work, whatever the machine's speed."""
    calls = iter(range(checks))
    return lambda deadline: 1.0 if next(calls, None) is not None else 0.0


def test_abandoned_generation_and_log_probs_stop_at_the_deadline_and_the_worker_serves_on(
    service, monkeypatch
):
    """Issue 12 defect 7: work whose caller had timed out ran on in the worker (the next
    2-row generation waited 74 s). The deadline now reaches the worker, which stops
    between tokens (generation) and micro-batches (log-probs)."""
    long = replace(SAMPLING, max_new_tokens=100, ignore_eos=True, responses_per_prompt=128)
    forwards = []
    decoder = service.worker.engine.module.get_decoder()  # log-probs skip the LM head module
    hook = decoder.register_forward_hook(lambda *_: forwards.append(1))
    deadline = Deadline(time.time() + 3600)
    try:
        monkeypatch.setattr(Deadline, "remaining_s", expiring_after(10))
        error = rpc_error(lambda: service.generate(prompts_batch(), long, deadline=deadline))
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED, error.message
        # a forward per token until the deadline passed, of the 100 the full run takes
        assert 0 < len(forwards) <= 10, len(forwards)
        monkeypatch.undo()
        assert service.generate(prompts_batch(), SAMPLING)[0]["responses"].shape == (8, 5)

        batch, _ = service.generate(prompts_batch(), replace(long, responses_per_prompt=32))
        monkeypatch.setattr(service.worker, "forward_micro_batch_samples", 4)  # 32 of them
        forwards.clear()
        monkeypatch.setattr(Deadline, "remaining_s", expiring_after(5))
        error = rpc_error(lambda: service.compute_log_prob(batch, deadline=deadline))
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED, error.message
        assert 0 < len(forwards) <= 5, len(forwards)
    finally:
        hook.remove()
    monkeypatch.undo()
    assert service.compute_log_prob(batch.index(slice(0, 2)))[0]["log_probs"].shape == (2, 100)


def test_requests_over_max_request_tokens_are_refused_before_any_work(service):
    """Issue 12 defect 7: 196 bytes (1 prompt × 4096 responses × 120 tokens) made the
    worker generate for 74 s and grow from 0.56 to 2.8 GB."""
    one_prompt = prompts_batch().index(slice(0, 1))  # 6 columns
    sampling = replace(SAMPLING, max_new_tokens=120, responses_per_prompt=4096)
    error = rpc_error(lambda: service.generate(one_prompt, sampling))
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.message.startswith(
        "prompts, sampling.responses_per_prompt, sampling.max_new_tokens: 1 prompts × 4096 "
        "responses × (6 prompt columns + 120 new tokens) = 516,096 token positions exceed "
        "this service's limit of 262,144 (its max_request_tokens setting); split the request"
    ), error.message
    ids = torch.ones(4096, 65, dtype=torch.long)  # 266,240 positions
    wide = Batch(
        {
            "input_ids": ids,
            "attention_mask": ids,
            "responses": ids[:, 1:],
            "response_mask": ids[:, 1:],
        }
    )
    step, version = service.controller.last_applied_step + 1, service.controller.weights_version
    calls = (service.compute_log_prob, lambda batch: service.update_actor(step, version, batch))
    for call in calls:
        error = rpc_error(lambda call=call: call(wide))
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.message.startswith(
            "batch.tensors['input_ids']: 4096 rows × 65 = 266,240 token positions exceed"
        ), error.message


def test_update_trains_syncs_generation_and_bumps_version(service):
    batch = service.update_batch(advantage=1.0)
    version, before = service.controller.weights_version, service.worker.policy_weights()
    result = service.update_actor(service.controller.last_applied_step + 1, version, batch)
    assert not result.replayed and result.weights_version == version + 1
    after = service.worker.policy_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm", "lr", "update_s"):
        assert math.isfinite(result.metrics[key]), key
    assert result.metrics["grad_norm"] > 0 and result.metrics["lr"] == 1e-2
    assert result.metrics["tokens"] == float(batch["response_mask"].sum())
    # Positive advantages on every sampled token make those tokens more likely.
    rescored, _ = service.compute_log_prob(batch)
    mask = batch["response_mask"].bool()
    assert rescored["log_probs"][mask].mean() > batch["old_log_probs"][mask].mean()
    assert rescored.meta["weights_version"] == version + 1
    # The generation engine runs the new weights: its log-probs match the trainer's.
    fresh, _ = service.generate(prompts_batch(), SAMPLING)
    assert fresh.meta["weights_version"] == version + 1
    scored, _ = service.compute_log_prob(fresh)
    torch.testing.assert_close(scored["log_probs"], fresh["rollout_log_probs"], atol=1e-4, rtol=0)


def test_replayed_step_returns_stored_result_and_does_not_train(service):
    batch = service.update_batch()
    step, version = service.controller.last_applied_step + 1, service.controller.weights_version
    first = service.update_actor(step, version, batch)
    weights = service.worker.policy_weights()
    # a retry carries the original (now stale) version: still answered by the replay
    again = service.update_actor(step, version, batch)
    assert again.replayed and again.metrics == first.metrics
    assert again.weights_version == first.weights_version == service.controller.weights_version
    assert all(torch.equal(w, service.worker.policy_weights()[k]) for k, w in weights.items())
    # another batch under that step (a second trainer's) is refused, and trains nothing
    different = service.update_batch(advantage=-1.0)
    with pytest.raises(RpcError) as refused:
        service.update_actor(step, version, different)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"step: {step} was already applied with another batch" in refused.value.message
    assert all(torch.equal(w, service.worker.policy_weights()[k]) for k, w in weights.items())
    assert service.update_actor(step, version, batch) == again  # the service still serves


def test_reset_returns_to_the_initial_weights_with_a_fresh_optimizer(process_group, tiny_model_dir):
    """After two updates and a Reset, the service is the one deployed: version 0, no
    applied step, the initial weights, and step 0 trains exactly as it did the first
    time (the optimizer's moments are gone too)."""
    service = Service(tiny_model_dir)
    initial = service.worker.policy_weights()
    batch = service.update_batch()
    first = service.update_actor(0, 0, batch)
    after_first = service.worker.policy_weights()
    service.update_actor(1, 1, service.update_batch(advantage=-1.0))

    assert service.reset() == (0, -1)
    assert service.controller.last_applied_step == -1
    weights = service.worker.policy_weights()
    assert all(torch.equal(weights[k], w) for k, w in initial.items())
    generated, _ = service.generate(prompts_batch(), SAMPLING)
    assert generated.meta["weights_version"] == 0  # the generation engine follows
    scored, _ = service.compute_log_prob(generated)
    torch.testing.assert_close(
        scored["log_probs"], generated["rollout_log_probs"], atol=1e-4, rtol=0
    )
    again = service.update_actor(0, 0, batch)
    assert not again.replayed and again.metrics["pg_loss"] == first.metrics["pg_loss"]
    weights = service.worker.policy_weights()
    assert all(torch.equal(weights[k], w) for k, w in after_first.items())


def test_old_steps_whose_result_is_gone_are_rejected(service):
    start = service.controller.last_applied_step + 1
    batches = {}
    for step in (start, start + 1, start + 2):  # keeps 2 results: start is dropped
        batches[step] = service.update_batch()
        service.update_actor(step, service.controller.weights_version, batches[step])
    version = service.controller.weights_version
    error = rpc_error(lambda: service.update_actor(start, version, batches[start]))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.message.startswith("step: ") and f"expects step {start + 3} next" in error.message
    assert "no longer kept" in error.message
    assert service.update_actor(start + 1, version, batches[start + 1]).replayed
    assert service.update_actor(start + 2, version, batches[start + 2]).replayed


def test_steps_that_skip_ahead_are_refused_and_poison_nothing(service):
    """Issue 12 defect 6: step 2^63-1 was applied, and every later real step refused."""
    batch = service.update_batch()
    expected, version = service.controller.last_applied_step + 1, service.controller.weights_version
    weights = service.worker.policy_weights()
    for step in (2**63 - 1, expected + 1):
        error = rpc_error(lambda s=step: service.update_actor(s, version, batch))
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert error.message.startswith("step: ")
        assert f"expects step {expected} next" in error.message
    assert service.controller.last_applied_step == expected - 1
    assert service.controller.weights_version == version
    assert all(torch.equal(w, service.worker.policy_weights()[k]) for k, w in weights.items())
    result = service.update_actor(expected, version, batch)  # the real step still trains
    assert not result.replayed and result.weights_version == version + 1


def test_zero_prompt_batch_is_invalid_argument_and_the_service_stays_usable(service):
    """Issue 12 defect 5: responses filling all of input_ids got INTERNAL from
    ComputeLogProb, and UpdateActor left the service refusing every call."""
    batch = service.update_batch()
    zero_prompt = Batch(
        {
            **batch.tensors,
            "input_ids": batch["responses"],
            "attention_mask": batch["response_mask"],
        },
        meta=batch.meta,
    )
    step, version = service.controller.last_applied_step + 1, service.controller.weights_version
    weights = service.worker.policy_weights()
    calls = {
        "ComputeLogProb": lambda: service.compute_log_prob(zero_prompt),
        "UpdateActor": lambda: service.update_actor(step, version, zero_prompt),
    }
    for name, call in calls.items():
        error = rpc_error(call)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT, (name, error.message)
        assert error.message.startswith("batch.tensors['input_ids']: needs more positions")
    # the same batch with its prompt columns all padding (it reached the workers: INTERNAL)
    prompt_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    masked = batch["attention_mask"].clone()
    masked[:, :prompt_len] = 0
    padded_prompt = Batch({**batch.tensors, "attention_mask": masked}, meta=batch.meta)
    calls = {
        "ComputeLogProb": lambda: service.compute_log_prob(padded_prompt),
        "UpdateActor": lambda: service.update_actor(step, version, padded_prompt),
    }
    for name, call in calls.items():
        error = rpc_error(call)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT, (name, error.message)
        assert error.message.startswith("batch.tensors['attention_mask']: row 0 has response")
    assert all(torch.equal(w, service.worker.policy_weights()[k]) for k, w in weights.items())
    assert (service.controller.last_applied_step, service.controller.weights_version) == (
        step - 1,
        version,
    )
    assert not service.update_actor(step, version, batch).replayed  # still usable


def test_versions_must_match(service):
    version = service.controller.weights_version
    batch = service.update_batch()
    step = service.controller.last_applied_step + 1
    for wrong, word in ((version - 1, "stale"), (version + 1, "unknown")):
        error = rpc_error(lambda w=wrong: service.update_actor(step, w, batch))
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert error.message.startswith("weights_version: ") and word in error.message
        error = rpc_error(lambda w=wrong: service.generate(prompts_batch(), SAMPLING, w))
        assert error.message.startswith("expected_weights_version: ") and word in error.message
        error = rpc_error(lambda w=wrong: service.compute_log_prob(batch, False, w))
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert service.generate(prompts_batch(), SAMPLING, version)[0].meta["weights_version"] == (
        version
    )
    assert service.controller.weights_version == version  # nothing was applied


def test_update_rows_must_tile_mini_batches(service):
    batch = service.update_batch().index(list(range(6)))  # mini-batch is 4 samples
    error = rpc_error(
        lambda: service.update_actor(
            service.controller.last_applied_step + 1, service.controller.weights_version, batch
        )
    )
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message.startswith("batch: 6 rows must be a multiple of ppo_mini_batch_samples")


def test_an_update_without_old_log_probs_must_be_one_optimizer_step(service):
    batch = service.update_batch()  # 8 rows, two mini-batches of 4
    without_old = batch.select(
        tensor_keys=[*SEQUENCE_KEYS, "advantages"], non_tensor_keys=[], meta_keys=[]
    )
    step, version = service.controller.last_applied_step + 1, service.controller.weights_version
    error = rpc_error(lambda: service.update_actor(step, version, without_old))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message.startswith("batch.tensors['old_log_probs']: may be left out only")
    assert not service.update_actor(step, version, batch).replayed  # still usable


def test_a_single_pass_update_takes_its_own_forward_as_the_old_log_probs(
    process_group, tiny_model_dir
):
    """One optimizer step over the whole batch: leaving old_log_probs out trains the
    same weights as sending ComputeLogProb's, and the response carries that forward's
    log-probs and entropy in the request's row order (the plan shuffles rows)."""
    config = {"ppo_mini_batch_samples": 8, "micro_batch_samples": 2, "seed": 3}
    sent, single = Service(tiny_model_dir, **config), Service(tiny_model_dir, **config)
    batch = sent.update_batch(advantage=1.0)
    entropy = sent.compute_log_prob(batch, return_entropy=True)[0]["entropy"]
    without_old = batch.select(
        tensor_keys=[*SEQUENCE_KEYS, "advantages"], non_tensor_keys=[], meta_keys=[]
    )
    with_old = sent.update_actor(0, 0, batch)
    result = single.update_actor(0, 0, without_old)
    assert with_old.scores is None and result.weights_version == 1
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(
        result.scores["log_probs"], batch["old_log_probs"], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(result.scores["entropy"], entropy, atol=1e-5, rtol=0)
    assert bool((result.scores["log_probs"][~mask] == 0).all())
    for key in ("pg_loss", "grad_norm", "entropy"):
        assert math.isclose(result.metrics[key], with_old.metrics[key], rel_tol=1e-4, abs_tol=1e-6)
    trained, reference = single.worker.policy_weights(), sent.worker.policy_weights()
    for key, weight in trained.items():
        torch.testing.assert_close(weight, reference[key], atol=1e-6, rtol=1e-5)
    replay = single.update_actor(0, 0, without_old)
    assert replay.replayed and torch.equal(replay.scores["log_probs"], result.scores["log_probs"])


def checkpoints_under(service: Service, root) -> None:
    """Confines the service's checkpoints to `root` (its config's checkpoint_root)."""
    settings = service.controller.settings
    service.controller.settings = replace(settings, checkpoint_root=str(root))


def test_checkpoint_restores_weights_version_and_replays(service, tmp_path):
    checkpoints_under(service, tmp_path)
    saved_version, saved_step = service.save_checkpoint("step_1/rollout")
    tmp_path = tmp_path / "step_1" / "rollout"
    assert (tmp_path / "model" / "model.safetensors").exists()
    assert (tmp_path / "model" / "tokenizer.json").exists()
    saved_weights = service.worker.policy_weights()
    probe = service.update_batch()
    probe_scores, _ = service.compute_log_prob(probe)
    service.update_actor(saved_step + 1, saved_version, probe)
    assert service.controller.weights_version == saved_version + 1
    assert service.load_checkpoint("step_1/rollout") == (saved_version, saved_step)
    restored = service.worker.policy_weights()
    assert all(torch.equal(saved_weights[k], restored[k]) for k in saved_weights)
    scores, _ = service.compute_log_prob(probe)
    assert torch.equal(scores["log_probs"], probe_scores["log_probs"])
    fresh, _ = service.generate(prompts_batch(), SAMPLING)  # generation engine restored too
    rescored, _ = service.compute_log_prob(fresh)
    torch.testing.assert_close(rescored["log_probs"], fresh["rollout_log_probs"], atol=1e-4, rtol=0)
    # the step after the checkpoint can be applied again; the saved step replays
    assert not service.update_actor(saved_step + 1, saved_version, probe).replayed
    error = rpc_error(lambda: service.load_checkpoint("missing"))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.message.startswith("location.path: no rollout checkpoint")


class _Payload:
    """Unpickling this runs code: it writes `marker` (what a crafted checkpoint did)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def test_checkpoints_stay_under_the_root_and_bad_ones_leave_the_service_serving(service, tmp_path):
    """Issue 12 defects 2-4: SaveCheckpoint wrote to any absolute path; a bad path or
    checkpoint was INTERNAL and left the rollout refusing all work; LoadCheckpoint
    unpickled a crafted state file."""
    checkpoints_under(service, tmp_path / "root")  # not whatever an earlier test left
    outside = tmp_path / "outside"
    for name in (str(outside), "/proc/self/x", "../outside", "a\x00b", ""):
        error = rpc_error(lambda n=name: service.save_checkpoint(n))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT, (name, error.message)
        assert error.message.startswith("location.path: ")
        error = rpc_error(lambda n=name: service.load_checkpoint(n))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT, (name, error.message)
    assert not outside.exists()

    root = tmp_path / "root"
    root.mkdir()
    checkpoints_under(service, root)
    (root / "a_file").write_text("x")
    for name, reason in (("a_file", "it is a file"), ("a_file/below", "is a file")):
        error = rpc_error(lambda n=name: service.save_checkpoint(n))
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION, error.message
        assert str(root / "a_file") in error.message and reason in error.message
        error = rpc_error(lambda n=name: service.load_checkpoint(n))
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION, error.message

    saved = service.save_checkpoint("good")
    # one update after the save, so a refused load that changed anything would show
    assert not service.update_actor(saved[1] + 1, saved[0], service.update_batch()).replayed
    version, step = service.controller.weights_version, service.controller.last_applied_step
    weights = service.worker.policy_weights()
    state_dir = root / "good" / "deepspeed" / "state"
    model_states = state_dir / "mp_rank_00_model_states.pt"
    original = model_states.read_bytes()
    marker = tmp_path / "marker"
    states = weights_only_load(model_states)
    # weights that load, beside a client state that cannot be restored: refused before
    # the weights change, not loaded and then left inconsistent
    bad_versions = {**states, "last_applied_step": "latest"}
    no_ledger = {key: value for key, value in states.items() if key != "updates"}
    variants = {
        "truncated": lambda: model_states.write_bytes(original[: len(original) // 2]),
        "pickle payload": lambda: torch.save({"module": _Payload(marker)}, model_states),
        "malformed client state": lambda: torch.save(bad_versions, model_states),
        "client state without its ledger": lambda: torch.save(no_ledger, model_states),
    }
    for variant, write in variants.items():
        write()
        error = rpc_error(lambda: service.load_checkpoint("good"))
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION, (variant, error.message)
        assert "no usable rollout checkpoint" in error.message, variant
        assert "keeps its current weights" in error.message, variant
    assert not marker.exists()
    # still serving what it had: same weights, not broken, generation and updates work
    assert all(torch.equal(w, service.worker.policy_weights()[k]) for k, w in weights.items())
    assert (service.controller.weights_version, service.controller.last_applied_step) == (
        version,
        step,
    )
    batch = service.update_batch()
    assert not service.update_actor(step + 1, version, batch).replayed
    model_states.write_bytes(original)
    assert service.load_checkpoint("good") == saved


def test_update_plan_is_the_same_whatever_the_worker_count():
    one = update_row_plan(rows=12, mini_batch_samples=4, workers=1, epochs=2, seed=5)[0]
    two = update_row_plan(rows=12, mini_batch_samples=4, workers=2, epochs=2, seed=5)
    assert len(one) == 24 and all(len(rank) == 12 for rank in two)
    for mini in range(6):  # mini-batch j = rank 0's share then rank 1's share
        expected = one[mini * 4 : (mini + 1) * 4].tolist()
        assert (
            two[0][mini * 2 : (mini + 1) * 2].tolist() + two[1][mini * 2 : (mini + 1) * 2].tolist()
            == expected
        )
    for epoch in range(2):
        assert sorted(one[epoch * 12 : (epoch + 1) * 12].tolist()) == list(range(12))


def test_lora_actor_trains_adapters_and_keeps_its_base_as_the_reference(
    process_group, tiny_model_dir, tmp_path
):
    from transformers import AutoModelForCausalLM

    lora = Service(tiny_model_dir, lora_rank=4, lora_alpha=8.0, serve_reference=True)
    worker = lora.worker
    assert worker.reference is None  # no second copy: the base with adapters off
    trainable = {n for n, p in worker.engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)
    batch = lora.update_batch(advantage=1.0)
    reference_before = worker.compute_ref_log_prob(batch)["ref_log_probs"]
    # Adapters start at B = 0: policy = base = reference.
    torch.testing.assert_close(reference_before, batch["old_log_probs"], atol=1e-5, rtol=0)
    base_before = {k: v.clone() for k, v in worker.policy_weights().items()}

    lora.update_actor(lora.controller.last_applied_step + 1, lora.controller.weights_version, batch)
    merged = worker.policy_weights()
    assert merged.keys() == base_before.keys()  # the plain model's names
    assert any(not torch.equal(merged[k], base_before[k]) for k in merged)
    rescored, _ = lora.compute_log_prob(batch)
    mask = batch["response_mask"].bool()
    assert rescored["log_probs"][mask].mean() > batch["old_log_probs"][mask].mean()
    # The reference did not move, and equals the plain initial model's scores.
    reference_after = worker.compute_ref_log_prob(batch)["ref_log_probs"]
    assert torch.equal(reference_after, reference_before)
    # Generation runs the merged weights: its log-probs match the trainer's.
    fresh, _ = lora.generate(prompts_batch(), SAMPLING)
    scored, _ = lora.compute_log_prob(fresh)
    torch.testing.assert_close(scored["log_probs"], fresh["rollout_log_probs"], atol=1e-4, rtol=0)

    checkpoints_under(lora, tmp_path)
    lora.save_checkpoint("lora")
    tmp_path = tmp_path / "lora"
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert all(torch.equal(plain.state_dict()[k], merged[k]) for k in merged)

    # Reset: adapters drawn again from the service's seed, so the same update lands on
    # the same merged weights; the reference (the base) never moved.
    assert lora.reset() == (0, -1)
    assert all(torch.equal(v, base_before[k]) for k, v in worker.policy_weights().items())
    assert torch.equal(worker.compute_ref_log_prob(batch)["ref_log_probs"], reference_before)
    lora.update_actor(0, 0, batch)
    assert all(torch.equal(v, merged[k]) for k, v in worker.policy_weights().items())


def test_lora_refuses_zero_stage_3(tiny_model_dir):
    with pytest.raises(Exception, match="zero_stage: 3 partitions the base weights"):
        RolloutServiceConfig(model_path=str(tiny_model_dir), lora_rank=4, zero_stage=3)


class CallRecorder:
    """Wraps a generation engine and records the calls the worker makes on it."""

    RECORDED = ("sleep", "wake_weights", "wake_up", "load_weights", "generate")

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        attribute = getattr(self.engine, name)
        if name not in self.RECORDED:
            return attribute

        def recorded(*args, **kwargs):
            self.calls.append(name)
            return attribute(*args, **kwargs)

        return recorded


def test_update_sleeps_the_generation_engine_and_wakes_it_for_the_sync(service, monkeypatch):
    """vllm.sleep_while_training's protocol (no-ops for 'hf'): sleep before training,
    wake the weights for the weight sync and the rest after it, and wake before
    generating (an update that failed half-way leaves the engine asleep)."""
    recorder = CallRecorder(service.worker.generation)
    monkeypatch.setattr(service.worker, "generation", recorder)
    batch = service.update_batch()
    assert recorder.calls == ["wake_up", "generate"]
    recorder.calls.clear()
    step, version = service.controller.last_applied_step + 1, service.controller.weights_version
    service.update_actor(step, version, batch)
    # The hf engine generates with the training module itself: nothing to load.
    assert recorder.calls == ["sleep", "wake_weights", "wake_up"]


def test_hf_generation_shares_the_training_module_only_where_it_holds_plain_weights(
    service, process_group, tiny_model_dir, tmp_path
):
    worker = service.worker
    assert worker.generation.model is worker.engine.module
    # Generating leaves the module's mode and its own generation config (saved with
    # checkpoints) as they were.
    worker.engine.train()
    config = worker.engine.module.generation_config
    service.generate(prompts_batch(), SAMPLING)
    assert worker.engine.module.training
    assert worker.engine.module.generation_config is config
    # Partitioned (ZeRO-3) or adapter-wrapped (LoRA) modules get a copy of their own.
    for overrides in ({"zero_stage": 3}, {"lora_rank": 4}):
        other = Service(tiny_model_dir, **overrides).worker
        assert other.generation.model is not other.engine.module, overrides


def test_zero3_actor_scores_and_trains_through_partitioned_weights(process_group, tiny_model_dir):
    """Scoring calls the backbone and the LM head as submodules (not the engine's
    forward): under ZeRO-3 their hooks must still gather the partitioned weights."""
    zero3 = Service(tiny_model_dir, zero_stage=3, logits_chunk_tokens=3)
    plain = Service(tiny_model_dir)
    batch = plain.update_batch(advantage=1.0)
    scored, _ = zero3.compute_log_prob(batch, return_entropy=True)
    torch.testing.assert_close(scored["log_probs"], batch["old_log_probs"], atol=1e-5, rtol=0)
    zero3.update_actor(zero3.controller.last_applied_step + 1, 0, batch)
    plain.update_actor(plain.controller.last_applied_step + 1, 0, batch)
    after_zero3, _ = zero3.compute_log_prob(batch)
    after_plain, _ = plain.compute_log_prob(batch)
    torch.testing.assert_close(
        after_zero3["log_probs"], after_plain["log_probs"], atol=1e-4, rtol=0
    )
    # Reset rebuilds the partitioned engine and sends its own generation engine (not
    # sharing the module under ZeRO-3) the initial weights.
    assert zero3.reset() == (0, -1)
    rescored, _ = zero3.compute_log_prob(batch)
    torch.testing.assert_close(rescored["log_probs"], batch["old_log_probs"], atol=1e-5, rtol=0)
    generated, _ = zero3.generate(prompts_batch(), SAMPLING)
    scored, _ = zero3.compute_log_prob(generated)
    torch.testing.assert_close(
        scored["log_probs"], generated["rollout_log_probs"], atol=1e-4, rtol=0
    )
    zero3.update_actor(0, 0, batch)
    again, _ = zero3.compute_log_prob(batch)
    torch.testing.assert_close(again["log_probs"], after_zero3["log_probs"], atol=1e-6, rtol=0)


def test_gradient_checkpointing_trains_the_same_weights(process_group, tiny_model_dir):
    recomputed = Service(tiny_model_dir, gradient_checkpointing=True)
    kept = Service(tiny_model_dir)
    batch = kept.update_batch(advantage=1.0)
    for service in (recomputed, kept):
        service.update_actor(service.controller.last_applied_step + 1, 0, batch)
    after_recomputed = recomputed.worker.policy_weights()
    after_kept = kept.worker.policy_weights()
    assert any(
        not torch.equal(after_kept[k], batch_weight)
        for k, batch_weight in Service(tiny_model_dir).worker.policy_weights().items()
    )
    for key, weight in after_kept.items():
        torch.testing.assert_close(after_recomputed[key], weight, atol=1e-6, rtol=0, msg=key)


def test_each_row_carries_its_mini_batch_counts():
    # 2 ranks, shares of 2 rows: rank r's block k is its half of mini-batch k
    def share(rows):
        return Batch({"response_mask": torch.tensor(rows)})

    rank0 = share([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    rank1 = share([[1, 1, 1], [1, 0, 0], [1, 0, 0], [0, 0, 0]])
    counted = with_mini_batch_counts([rank0, rank1], share_rows=2)
    # mini-batch 0: 3 + 4 tokens in 4 sequences; mini-batch 1: 3 + 1 tokens, 2 with any
    for rank in counted:
        assert rank["mini_batch_tokens"].tolist() == [7.0, 7.0, 4.0, 4.0]
        assert rank["mini_batch_sequences"].tolist() == [4.0, 4.0, 2.0, 2.0]
    assert torch.equal(counted[0]["response_mask"], rank0["response_mask"])


def test_zero_width_responses_cross_to_the_workers_and_back(service):
    """Issue 27 item 16: 2 rows, a 1-column prompt and a 0-column response answered
    INTERNAL (the empty tensor did not survive Ray's pickling). Both shapes must come
    back as a clean answer: log-probs of 0 columns, or INVALID_ARGUMENT naming a field."""
    prompt = torch.tensor([[3], [4]])
    empty = torch.zeros(2, 0, dtype=torch.long)
    batch = Batch(
        {
            "prompts": prompt,
            "responses": empty,
            "response_mask": empty,
            "input_ids": prompt,
            "attention_mask": torch.ones_like(prompt),
        },
        meta={"weights_version": service.controller.weights_version},
    )
    batch = pickle.loads(pickle.dumps(batch, protocol=5))  # as Ray carries it to a worker
    try:
        scores, _ = service.compute_log_prob(batch)
    except RpcError as error:
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT, error.message
        assert error.message.startswith("batch."), error.message
    else:
        assert scores["log_probs"].shape == (2, 0)


def test_observation_tokens_change_no_update(process_group, tiny_model_dir):
    """A multi-turn batch's observations (response mask 0 inside a response) count in no
    loss: changing what a loss could read there (advantages, old log-probs) leaves the
    trained weights identical, while the same change on the model's tokens does not."""
    base = Service(tiny_model_dir).update_batch(advantage=1.0)
    mask = base["response_mask"].clone()
    observation = torch.zeros_like(mask, dtype=torch.bool)
    observation[:, 1:3] = mask[:, 1:3].bool()  # two positions of every row become a tool's
    assert observation.any()
    mask[observation] = 0
    tensors = {**base.tensors, "response_mask": mask}

    def trained(changed: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = Batch(
            {
                **tensors,
                "advantages": torch.where(changed, 5.0, tensors["advantages"]),
                "old_log_probs": torch.where(changed, -0.3, tensors["old_log_probs"]),
            },
            meta=base.meta,
        )
        service = Service(tiny_model_dir)
        service.update_actor(0, 0, batch)
        return service.worker.policy_weights()

    untouched = trained(torch.zeros_like(observation))
    at_observations = trained(observation)
    for key, weight in untouched.items():
        assert torch.equal(at_observations[key], weight), key
    at_model_tokens = trained(mask.bool() & ~observation)
    assert any(not torch.equal(at_model_tokens[k], w) for k, w in untouched.items())
