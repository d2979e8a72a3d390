"""RolloutService deployed on Serve, called through the gRPC proxy with generated stubs.

Two apps on the session's cluster start from the same tiny model: `dp1` (1 worker,
ZeRO-0) and `dp2` (2 workers, ZeRO-1). Right after deployment each saves a checkpoint of
its initial state; the DP comparison loads those first, so it does not depend on which
tests ran before it. Weight sync, replay and checkpoint tests run on dp2 (two ranks);
invalid requests never apply anything.

Tolerances: DP=2 vs DP=1 greedy tokens are equal; log-probs agree within 1e-5 (same
math, other reduction order; measured 5e-7); after one UpdateActor (AdamW, lr 1e-2) the
weights agree within 1e-5 (Adam's first step moves each weight by ≈ lr, so 1e-5 is 0.1%
of the step; measured 4e-7) and the metrics within a relative 1e-4.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from ray import serve
from safetensors.torch import load_file

from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.rpc import call_metadata
from rlserve.core.serving import deadline_metadata
from rlserve.rollout.app import build_app
from rlserve.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

TIMEOUT_S = 120.0
PROMPT_ROWS = [[1, 21, 15, 22, 33], [1, 23, 23, 15, 24, 24], [1, 40], [1, 50, 51], [1, 60]]
COMMON = {
    "ppo_mini_batch_samples": 8,
    "micro_batch_samples": 2,
    "lr": 1e-2,
    "ppo_epochs": 1,
    "max_batch_samples": 64,
    "max_new_tokens_limit": 32,
}
APPS = {
    "rollout-dp1": {"workers": 1, "zero_stage": 0},
    "rollout-dp2": {"workers": 2, "zero_stage": 1},
}


@dataclass
class App:
    name: str
    stub: rollout_pb2_grpc.RolloutServiceStub
    initial_checkpoint: Path | None = None
    """Where the fixture saved the app's state right after deployment (version 0)."""
    checkpoint_root: Path | None = None
    """The app's checkpoint_root: save/load send paths relative to it."""

    def call(self, rpc: str, request, extra_metadata=()):
        return getattr(self.stub, rpc)(
            request, metadata=call_metadata(self.name, *extra_metadata), timeout=TIMEOUT_S
        )

    def info(self) -> common_pb2.ServiceInfo:
        return self.call("GetInfo", rollout_pb2.RolloutServiceGetInfoRequest()).info

    def generate(self, prompts: Batch, **sampling) -> Batch:
        request = generate_request(prompts, **sampling)
        return batch_from_proto(self.call("GenerateSequences", request).batch)

    def log_probs(self, batch: Batch) -> torch.Tensor:
        request = rollout_pb2.ComputeLogProbRequest(batch=batch_to_proto(sequences(batch)))
        return batch_from_proto(self.call("ComputeLogProb", request).batch)["log_probs"]

    def update(self, step: int, version: int, batch: Batch) -> rollout_pb2.UpdateActorResponse:
        request = rollout_pb2.UpdateActorRequest(
            step=step, weights_version=version, batch=batch_to_proto(batch)
        )
        return self.call("UpdateActor", request)

    def save(self, path) -> rollout_pb2.RolloutServiceSaveCheckpointResponse:
        location = common_pb2.CheckpointLocation(path=self._name(path))
        return self.call(
            "SaveCheckpoint", rollout_pb2.RolloutServiceSaveCheckpointRequest(location=location)
        )

    def load(self, path) -> rollout_pb2.RolloutServiceLoadCheckpointResponse:
        location = common_pb2.CheckpointLocation(path=self._name(path))
        return self.call(
            "LoadCheckpoint", rollout_pb2.RolloutServiceLoadCheckpointRequest(location=location)
        )

    def _name(self, path) -> str:
        """A test's directory as the service names it: relative to its checkpoint_root."""
        return str(Path(path).resolve().relative_to(self.checkpoint_root))


def prompts_batch(rows=PROMPT_ROWS) -> Batch:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    answers = [str(i) for i in range(len(rows))]
    return Batch({"input_ids": ids, "attention_mask": mask}, {"ground_truth": answers})


def generate_request(prompts: Batch, **sampling) -> rollout_pb2.GenerateSequencesRequest:
    params = {"temperature": 0.0, "max_new_tokens": 6, **sampling}
    return rollout_pb2.GenerateSequencesRequest(
        prompts=batch_to_proto(prompts),
        sampling=rollout_pb2.SamplingParams(**params),
        return_log_probs=True,
    )


def sequences(batch: Batch) -> Batch:
    keys = ["input_ids", "attention_mask", "responses", "response_mask"]
    return batch.select(tensor_keys=keys, non_tensor_keys=[])


def update_batch(app: App, prompts: Batch, seed: int = 0) -> Batch:
    """8 sampled sequences scored by `app`, with fixed pseudo-random advantages."""
    generated = app.generate(prompts, temperature=1.0, responses_per_prompt=2, seed=seed)
    old = app.log_probs(generated)
    mask = generated["response_mask"].float()
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed)) * mask
    tensors = {**sequences(generated).tensors, "old_log_probs": old, "advantages": advantages}
    return Batch(tensors, meta=generated.meta)


@pytest.fixture(scope="module")
def apps(serve_cluster, tiny_model_dir, tmp_path_factory):
    channel = serve_cluster.channel()
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    # Every tmp_path lies under pytest's base temp dir: the apps' checkpoint root.
    root = tmp_path_factory.getbasetemp().resolve()
    # Deployed together: their workers start in parallel.
    serve.run_many(
        [
            serve.RunTarget(
                build_app(
                    {
                        "model_path": str(tiny_model_dir),
                        "checkpoint_root": str(root),
                        **COMMON,
                        **overrides,
                    }
                ),
                name=name,
                route_prefix=f"/{name}",
            )
            for name, overrides in APPS.items()
        ]
    )
    apps = {name.removeprefix("rollout-"): App(name, stub, checkpoint_root=root) for name in APPS}
    initial = tmp_path_factory.mktemp("initial")
    for key, app in apps.items():
        app.initial_checkpoint = initial / key
        app.save(app.initial_checkpoint)
    yield apps
    for name in APPS:
        serve.delete(name)
    channel.close()


def test_get_info_describes_service_and_workers(apps, tiny_model_dir):
    info = apps["dp2"].info()
    assert (info.role, info.model, info.engine) == ("rollout", str(tiny_model_dir), "hf")
    assert info.weights_version >= 0 and info.rlserve_version == "0.1.0"
    assert [w.rank for w in info.workers] == [0, 1]
    assert len({w.pid for w in info.workers}) == 2
    assert all(w.node_id and w.hostname and w.pid > 0 for w in info.workers)


def test_dp2_agrees_with_dp1(apps, tmp_path):
    dp1, dp2 = apps["dp1"], apps["dp2"]
    for app in (dp1, dp2):
        assert app.load(app.initial_checkpoint).weights_version == 0
    prompts = prompts_batch()  # 5 prompts: dp2 pads one row for an even split
    greedy1, greedy2 = dp1.generate(prompts), dp2.generate(prompts)
    assert torch.equal(greedy1["responses"], greedy2["responses"])
    assert greedy1["uid"] == greedy2["uid"] == list(range(5))
    torch.testing.assert_close(
        greedy1["rollout_log_probs"], greedy2["rollout_log_probs"], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(dp1.log_probs(greedy1), dp2.log_probs(greedy1), atol=1e-5, rtol=0)

    batch = update_batch(dp1, prompts_batch(PROMPT_ROWS[:4]))
    result1, result2 = dp1.update(0, 0, batch), dp2.update(0, 0, batch)
    assert result1.weights_version == result2.weights_version == 1
    for key in ("pg_loss", "ppo_kl", "pg_clipfrac", "entropy", "grad_norm"):
        assert result1.metrics[key] == pytest.approx(result2.metrics[key], rel=1e-4, abs=1e-6)
    assert result1.metrics["tokens"] == result2.metrics["tokens"]
    dp1.save(tmp_path / "dp1")
    dp2.save(tmp_path / "dp2")
    weights1 = load_file(tmp_path / "dp1" / "model" / "model.safetensors")
    weights2 = load_file(tmp_path / "dp2" / "model" / "model.safetensors")
    assert weights1.keys() == weights2.keys()
    for key in weights1:
        torch.testing.assert_close(weights1[key], weights2[key], atol=1e-5, rtol=0)
    assert torch.equal(dp1.generate(prompts)["responses"], dp2.generate(prompts)["responses"])


def test_update_syncs_generation_and_replays_retries(apps):
    app = apps["dp2"]
    info = app.info()
    version, step = info.weights_version, info.last_applied_step + 1
    greedy_before = app.generate(prompts_batch())
    batch = update_batch(app, prompts_batch(PROMPT_ROWS[:4]), seed=step)
    result = app.update(step, version, batch)
    assert not result.replayed and result.weights_version == version + 1
    assert result.metrics["grad_norm"] > 0 and result.metrics["tokens"] > 0

    # The generation engine now runs the new weights: its log-probs of its own greedy
    # tokens moved, and they equal the trainer's ComputeLogProb of the same tokens.
    greedy_after = app.generate(prompts_batch())
    assert greedy_after.meta["weights_version"] == version + 1
    scored = app.log_probs(greedy_after)
    torch.testing.assert_close(greedy_after["rollout_log_probs"], scored, atol=1e-4, rtol=0)
    rescored_before = app.log_probs(greedy_before)
    moved = (rescored_before - greedy_before["rollout_log_probs"]).abs().max()
    assert moved > 1e-3

    # A retry (same step and batch, its original version) is replayed, not applied.
    replay = app.update(step, version, batch)
    assert replay.replayed and replay.weights_version == version + 1
    assert dict(replay.metrics) == dict(result.metrics)
    assert app.info().weights_version == version + 1
    assert torch.equal(app.log_probs(greedy_before), rescored_before)  # weights unchanged

    # A new step built on the old version is refused, as is generation pinned to it.
    with pytest.raises(grpc.RpcError) as stale:
        app.update(step + 1, version, batch)
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stale.value.details().startswith("weights_version: ")
    with pytest.raises(grpc.RpcError) as pinned:
        app.call("GenerateSequences", rollout_request_pinned(version))
    assert pinned.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert pinned.value.details().startswith("expected_weights_version: ")


def rollout_request_pinned(version: int) -> rollout_pb2.GenerateSequencesRequest:
    request = generate_request(prompts_batch())
    request.expected_weights_version = version
    return request


def test_checkpoint_save_update_load_restores_weights_and_version(apps, tmp_path):
    app = apps["dp2"]
    saved = app.save(tmp_path)
    info = app.info()
    assert (saved.weights_version, saved.last_applied_step) == (
        info.weights_version,
        info.last_applied_step,
    )
    assert (tmp_path / "model" / "model.safetensors").exists()
    assert (tmp_path / "deepspeed").is_dir()
    probe = app.generate(prompts_batch())
    scores_at_save = app.log_probs(probe)
    batch = update_batch(app, prompts_batch(PROMPT_ROWS[:4]), seed=99)
    step = saved.last_applied_step + 1
    assert app.update(step, saved.weights_version, batch).weights_version == (
        saved.weights_version + 1
    )
    assert not torch.equal(app.log_probs(probe), scores_at_save)

    loaded = app.load(tmp_path)
    assert (loaded.weights_version, loaded.last_applied_step) == (
        saved.weights_version,
        saved.last_applied_step,
    )
    assert app.info().weights_version == saved.weights_version
    assert torch.equal(app.log_probs(probe), scores_at_save)
    regenerated = app.generate(prompts_batch())  # the generation engine is restored too
    assert torch.equal(regenerated["responses"], probe["responses"])
    torch.testing.assert_close(
        regenerated["rollout_log_probs"], probe["rollout_log_probs"], atol=1e-6, rtol=0
    )


# ---- invalid requests: status + field, then the replica keeps serving -------------------


def _generate(app: App, prompts: Batch | None = None, **sampling):
    prompts = prompts_batch() if prompts is None else prompts
    return "GenerateSequences", generate_request(prompts, **sampling)


def _with(batch: Batch, **tensors) -> Batch:
    return Batch({**batch.tensors, **tensors}, batch.non_tensors, batch.meta)


def _malformed_prompts(app: App):
    rpc, request = _generate(app)
    request.prompts.tensors["input_ids"].data = b"\0" * 3
    return rpc, request


def _update(app: App, batch: Batch, step: int | None = None, version: int | None = None):
    info = app.info()
    request = rollout_pb2.UpdateActorRequest(
        step=info.last_applied_step + 1 if step is None else step,
        weights_version=info.weights_version if version is None else version,
        batch=batch_to_proto(batch),
    )
    return "UpdateActor", request


def _log_prob(batch: Batch):
    return "ComputeLogProb", rollout_pb2.ComputeLogProbRequest(batch=batch_to_proto(batch))


@pytest.fixture(scope="module")
def valid_update(apps) -> Batch:
    """A well-formed update batch for dp1 (never applied: each case breaks one thing)."""
    return update_batch(apps["dp1"], prompts_batch(PROMPT_ROWS[:4]), seed=3)


def _prompts(**tensors) -> Batch:
    return _with(prompts_batch(), **tensors)


P_IDS, P_MASK = "prompts.tensors['input_ids']", "prompts.tensors['attention_mask']"
INVALID, EXHAUSTED, PRECONDITION = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)
PROMPTS = prompts_batch()
# id: (app, build(app, valid_update) -> (rpc, request), status, start of the details)
CASES = {
    "empty batch": (
        "dp1",
        lambda app, u: _generate(
            app,
            Batch(
                {k: torch.zeros(0, 3, dtype=torch.long) for k in ("input_ids", "attention_mask")}
            ),
        ),
        INVALID,
        "prompts: empty batch",
    ),
    "ids dtype": (
        "dp1",
        lambda app, u: _generate(app, _prompts(input_ids=PROMPTS["input_ids"].float())),
        INVALID,
        f"{P_IDS}: dtype must be int64 or int32",
    ),
    "ids outside vocab": (
        "dp1",
        lambda app, u: _generate(app, _prompts(input_ids=PROMPTS["input_ids"] + 1000)),
        INVALID,
        f"{P_IDS}: token ids must lie in",
    ),
    "mask shape": (
        "dp1",
        lambda app, u: _generate(app, _prompts(attention_mask=PROMPTS["attention_mask"][:, 1:])),
        INVALID,
        f"{P_MASK}: shape",
    ),
    "right-padded prompts": (
        "dp1",
        lambda app, u: _generate(app, _prompts(attention_mask=PROMPTS["attention_mask"].flip(1))),
        INVALID,
        f"{P_MASK}: row 0 is not left-padded",
    ),
    "malformed tensor": (
        "dp1",
        lambda app, u: _malformed_prompts(app),
        INVALID,
        "tensors['input_ids'].data",
    ),
    "max_new_tokens 0": (
        "dp1",
        lambda app, u: _generate(app, max_new_tokens=0),
        INVALID,
        "sampling.max_new_tokens: must be >= 1",
    ),
    "max_new_tokens over limit": (
        "dp1",
        lambda app, u: _generate(app, max_new_tokens=33),
        EXHAUSTED,
        "sampling.max_new_tokens: 33 exceeds",
    ),
    "top_p above 1": ("dp1", lambda app, u: _generate(app, top_p=1.5), INVALID, "sampling.top_p"),
    "negative temperature": (
        "dp1",
        lambda app, u: _generate(app, temperature=-1.0),
        INVALID,
        "sampling.temperature",
    ),
    "too many samples": (
        "dp1",
        lambda app, u: _generate(app, responses_per_prompt=13),
        EXHAUSTED,
        "prompts, sampling.responses_per_prompt: 5 prompts × 13 responses exceed",
    ),
    "unknown expected version": (
        "dp1",
        lambda app, u: ("GenerateSequences", rollout_request_pinned(99)),
        PRECONDITION,
        "expected_weights_version: 99 is unknown",
    ),
    "response_mask shape": (
        "dp1",
        lambda app, u: _log_prob(_with(u, response_mask=u["response_mask"][:, :-1])),
        INVALID,
        "batch.tensors['response_mask']: shape",
    ),
    "responses differ from input_ids": (
        "dp1",
        lambda app, u: _log_prob(_with(u, responses=(u["responses"] + 1) % 90)),
        INVALID,
        "batch.tensors['responses']: must equal the last R columns",
    ),
    "missing responses": (
        "dp1",
        lambda app, u: _log_prob(u.select(tensor_keys=["input_ids", "attention_mask"])),
        INVALID,
        "batch.tensors['responses']: missing",
    ),
    "oversized batch": (
        "dp1",
        lambda app, u: _log_prob(u.index(torch.arange(65) % len(u))),
        EXHAUSTED,
        "batch: 65 rows exceed",
    ),
    "NaN advantages": (
        "dp1",
        lambda app, u: _update(app, _with(u, advantages=u["advantages"] * float("nan"))),
        INVALID,
        "batch.tensors['advantages']: 48 values are NaN or infinite",
    ),
    "integer advantages": (
        "dp1",
        lambda app, u: _update(app, _with(u, advantages=u["advantages"].long())),
        INVALID,
        "batch.tensors['advantages']: dtype must be",
    ),
    "old_log_probs shape": (
        "dp1",
        lambda app, u: _update(app, _with(u, old_log_probs=u["old_log_probs"][:, :2])),
        INVALID,
        "batch.tensors['old_log_probs']: shape",
    ),
    "unknown update version": (
        "dp1",
        lambda app, u: _update(app, u, version=99),
        PRECONDITION,
        "weights_version: 99 is unknown",
    ),
    "negative step": (
        "dp1",
        lambda app, u: _update(app, u, step=-1),
        INVALID,
        "step: must be >= 0",
    ),
    "rows not divisible by workers": (
        "dp2",
        lambda app, u: _update(app, u.index([0, 1, 2])),
        INVALID,
        "batch: 3 rows must be a multiple of the 2 workers",
    ),
    "absolute checkpoint path": (
        "dp1",
        lambda app, u: (
            "SaveCheckpoint",
            rollout_pb2.RolloutServiceSaveCheckpointRequest(
                location=common_pb2.CheckpointLocation(path="/tmp/elsewhere")
            ),
        ),
        INVALID,
        "location.path: '/tmp/elsewhere' is absolute",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_request_names_the_field_and_replica_keeps_serving(apps, valid_update, case):
    app_name, build, code, details = CASES[case]
    app = apps[app_name]
    version = app.info().weights_version
    rpc, request = build(app, valid_update)
    with pytest.raises(grpc.RpcError) as error:
        app.call(rpc, request)
    assert error.value.code() == code, error.value.details()
    assert error.value.details().startswith(details), error.value.details()
    assert app.info().weights_version == version  # nothing was applied
    assert app.log_probs(valid_update).shape == valid_update["responses"].shape


def test_passed_deadline_is_deadline_exceeded(apps, valid_update):
    app = apps["dp1"]
    rpc, request = _log_prob(sequences(valid_update))
    with pytest.raises(grpc.RpcError) as error:
        app.call(rpc, request, extra_metadata=(deadline_metadata(-1.0),))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert app.call(rpc, request, extra_metadata=(deadline_metadata(60.0),)).batch.tensors


def test_an_abandoned_generation_does_not_hold_up_the_next_one(serve_cluster, tiny_model_dir):
    """Issue 12 defect 7, through Serve: 1 prompt × 4096 responses × 120 tokens timed out
    for its caller at 5 s, yet the next 2-row generation waited 74 s behind it. The
    deadline now reaches the worker, which stops at the next token."""
    name = "rollout-deadline"
    limits = {"max_new_tokens_limit": 120, "max_request_tokens": 600_000}
    serve.run(
        build_app({"model_path": str(tiny_model_dir), **limits}), name=name, route_prefix=f"/{name}"
    )
    channel = serve_cluster.channel()
    try:
        app = App(name, rollout_pb2_grpc.RolloutServiceStub(channel))
        small = generate_request(prompts_batch(PROMPT_ROWS[:2]))
        app.call("GenerateSequences", small)  # warm
        big = generate_request(
            prompts_batch(PROMPT_ROWS[:1]),
            temperature=1.0,
            max_new_tokens=120,
            responses_per_prompt=4096,
            ignore_eos=True,
        )
        with pytest.raises(grpc.RpcError) as error:
            app.stub.GenerateSequences(
                big, metadata=call_metadata(name, deadline_metadata(2.0)), timeout=2.0
            )
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        started = time.monotonic()
        assert len(batch_from_proto(app.call("GenerateSequences", small).batch)) == 2
        assert time.monotonic() - started < 5.0
    finally:
        serve.delete(name)
        channel.close()
