"""DeepSpeed engine helpers, in-process with world size 1 (gloo)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.core.process_group import init_process_group
from rlserve.core.training import (
    OptimizerSettings,
    build_training_engine,
    deepspeed_config,
    full_state_dict,
    grad_norm,
    load_training_checkpoint,
    minibatch_indices,
    save_training_checkpoint,
)


def test_minibatch_indices_cover_every_row_once_per_epoch():
    batches = list(minibatch_indices(12, 4, epochs=2, seed=0))
    assert len(batches) == 6
    for epoch in (0, 1):
        rows = torch.cat([idx for e, idx in batches if e == epoch])
        assert sorted(rows.tolist()) == list(range(12))
    assert not torch.equal(batches[0][1], batches[3][1])  # reshuffled each epoch
    again = list(minibatch_indices(12, 4, epochs=2, seed=0))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True))


def test_deepspeed_config_rejects_unknown_stage():
    assert deepspeed_config(2, 4, 2, 1.0)["zero_optimization"] == {"stage": 2}
    with pytest.raises(ValueError, match="zero_stage: must be 0, 1, 2 or 3, got 4"):
        deepspeed_config(4, 4, 2, 1.0)


def _optimizer(zero_stage: int, grad_accum_steps: int = 1) -> OptimizerSettings:
    return OptimizerSettings(
        lr=1e-2,
        weight_decay=0.0,
        zero_stage=zero_stage,
        grad_clip=1.0,
        micro_batch_samples=2,
        grad_accum_steps=grad_accum_steps,
    )


@pytest.fixture(scope="module")
def process_group():
    init_process_group(0, 1, "127.0.0.1", 0)


def test_engine_trains_and_checkpoint_restores(process_group, tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = build_training_engine(model, _optimizer(zero_stage=1, grad_accum_steps=2))
    ids = torch.randint(4, 20, (4, 6))
    before = full_state_dict(engine)
    losses = []
    for _ in range(3):
        for micro in ids.split(2):  # two micro-batches = one optimizer step
            loss = engine(input_ids=micro, labels=micro).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert grad_norm(engine) > 0
    assert engine.global_steps == 3
    save_training_checkpoint(engine, tmp_path, client_state={"weights_version": 3})
    trained = full_state_dict(engine)
    assert any(not torch.equal(before[k], trained[k]) for k in before)

    loss = engine(input_ids=ids[:2], labels=ids[:2]).loss
    engine.backward(loss)
    engine.step()
    engine.backward(engine(input_ids=ids[2:], labels=ids[2:]).loss)
    engine.step()
    assert load_training_checkpoint(engine, tmp_path)["weights_version"] == 3
    restored = full_state_dict(engine)
    assert all(torch.equal(trained[k], restored[k]) for k in trained)
    with pytest.raises(FileNotFoundError, match="no DeepSpeed checkpoint"):
        load_training_checkpoint(engine, tmp_path / "missing")


class _Payload:
    """Unpickling this runs code: it writes `marker` (what a crafted checkpoint did)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


@pytest.mark.parametrize(
    "victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
)
def test_a_pickle_payload_in_a_checkpoint_never_runs(
    process_group, tiny_model_dir, tmp_path, victim
):
    """Issue 12 defect 2: DeepSpeed's loader unpickled a crafted state file."""
    from rlserve.core import training

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = build_training_engine(model, _optimizer(zero_stage=1))
    save_training_checkpoint(engine, tmp_path, client_state={"weights_version": 1})
    weights = full_state_dict(engine)
    marker = tmp_path / "marker"
    torch.save(
        {"module": _Payload(marker), "optimizer_state_dict": {}}, tmp_path / "state" / victim
    )
    with pytest.raises(Exception, match="refused by weights-only loading"):
        training.load_training_checkpoint(engine, tmp_path)
    assert not marker.exists()
    with pytest.raises(training.UnsafeCheckpointError, match=victim):
        training.check_training_checkpoint(tmp_path, rank=0)
    assert not marker.exists()
    assert all(torch.equal(weights[k], v) for k, v in full_state_dict(engine).items())


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_weights_only_loading_reads_every_stage_checkpoint(
    process_group, tiny_model_dir, tmp_path, zero_stage
):
    from rlserve.core.training import UnsafeCheckpointError, check_training_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = build_training_engine(model, _optimizer(zero_stage=zero_stage))
    ids = torch.randint(4, 20, (2, 6))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    save_training_checkpoint(engine, tmp_path, client_state={"weights_version": 1})
    trained = full_state_dict(engine)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    client_state = check_training_checkpoint(tmp_path, 0, ["weights_version", "absent"])
    assert client_state == {"weights_version": 1}
    assert load_training_checkpoint(engine, tmp_path)["weights_version"] == 1
    assert all(torch.equal(trained[k], v) for k, v in full_state_dict(engine).items())
    state_file = sorted((tmp_path / "state").glob("*.pt"))[0]
    state_file.write_bytes(state_file.read_bytes()[:100])  # a truncated (corrupt) file
    with pytest.raises(UnsafeCheckpointError, match="refused by weights-only loading"):
        check_training_checkpoint(tmp_path, rank=0)


def _one_update(model_dir, dtype: str, reduce_at_one_rank: bool) -> tuple[dict, bool]:
    """Weights after one ZeRO-0 step on a fixed batch, and whether the engine reduced."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    engine = build_training_engine(model, _optimizer(zero_stage=0), dtype)
    if reduce_at_one_rank:
        engine.enable_backward_allreduce = True
    ids = torch.arange(4, 16).reshape(2, 6)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return full_state_dict(engine), engine.enable_backward_allreduce


def test_skipping_the_one_rank_reduction_in_float32_changes_no_weight(
    process_group, tiny_model_dir
):
    skipped, reduces = _one_update(tiny_model_dir, "float32", reduce_at_one_rank=False)
    assert not reduces
    reduced, _ = _one_update(tiny_model_dir, "float32", reduce_at_one_rank=True)
    assert all(torch.equal(skipped[name], reduced[name]) for name in skipped)


def test_bf16_keeps_its_reduction_at_one_rank(process_group, tiny_model_dir):
    """bf16 reduces in bf16, rounding the gradients: no no-op, so one rank (a one-GPU
    run) takes the same reduction path as several, here over gloo."""
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    after, reduces = _one_update(tiny_model_dir, "bfloat16", reduce_at_one_rank=False)
    assert reduces
    assert all(torch.isfinite(weight.float()).all() for weight in after.values())
    assert any(not torch.equal(before.state_dict()[name], after[name]) for name in after)
