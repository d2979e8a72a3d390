"""What follows a worker's device: the model dtype ('auto'), TF32 matmuls, the AdamW
kernel and the LM-head chunk; and the bf16 DeepSpeed path 'auto' picks on GPUs, run on
the CPU. No GPU here: CUDA's presence and bf16 support are monkeypatched into torch's
own probes, which is all the choices read."""

import pytest
import torch

from rlserve.core.cluster import free_port
from rlserve.core.inputs_config import LARGE_MODEL_WEIGHT_BYTES
from rlserve.core.modeling import load_causal_lm, resolve_dtype
from rlserve.core.process_group import init_process_group
from rlserve.core.rank_worker import RankSetup, RankWorker
from rlserve.core.response_scoring import (
    CPU_CHUNK_TOKENS,
    CUDA_CHUNK_TOKENS,
    resolve_chunk_tokens,
)
from rlserve.core.run_config import RunConfig
from rlserve.core.training import (
    OptimizerSettings,
    adamw,
    build_training_engine,
    deepspeed_config,
    full_state_dict,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def fake_gpu(monkeypatch: pytest.MonkeyPatch, native_bf16: bool) -> None:
    """torch sees a GPU; with native_bf16 False, one that runs bf16 only emulated
    (before Ampere), as torch.cuda.is_bf16_supported reports it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: native_bf16 or including_emulation,
    )


# --- dtype ------------------------------------------------------------------------------


def test_auto_is_float32_without_a_gpu():
    assert resolve_dtype("auto", CPU) == "float32"


def test_auto_is_bfloat16_on_a_gpu_with_native_bf16(monkeypatch):
    fake_gpu(monkeypatch, native_bf16=True)
    assert resolve_dtype("auto", CUDA) == "bfloat16"


def test_auto_is_float32_on_a_gpu_that_only_emulates_bf16(monkeypatch):
    # Not float16: its loss scaling would skip PPO updates on overflow (resolve_dtype).
    fake_gpu(monkeypatch, native_bf16=False)
    assert resolve_dtype("auto", CUDA) == "float32"


def test_auto_on_a_cpu_worker_stays_float32_on_a_gpu_machine(monkeypatch):
    fake_gpu(monkeypatch, native_bf16=True)
    assert resolve_dtype("auto", CPU) == "float32"


@pytest.mark.parametrize("setting", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_kept_on_any_device(monkeypatch, setting):
    fake_gpu(monkeypatch, native_bf16=True)
    assert resolve_dtype(setting, CPU) == resolve_dtype(setting, CUDA) == setting


def test_an_unknown_dtype_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"dtype: 'fp8' is not one of \['auto', 'bfloat16'"):
        resolve_dtype("fp8", CPU)


def rank_worker(**setup: str) -> RankWorker:
    """A rank (RankWorker loads no model) that keeps this process's torch threads."""
    return RankWorker(0, 1, RankSetup("unused", num_threads=torch.get_num_threads(), **setup))


def test_the_default_run_still_computes_in_float32_on_the_cpu():
    # The embedded default's measured numbers were float32 runs; 'auto' must keep them.
    assert RunConfig().model.dtype == "auto"
    assert rank_worker(device="cpu").dtype == "float32"


@pytest.fixture
def kept_matmul_precision():
    """The process's float32 matmul precision, restored after the test changes it."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    ("native_bf16", "dtype", "precision"),
    [(False, "float32", "high"), (True, "bfloat16", "highest")],
)
def test_a_cuda_worker_resolves_auto_and_uses_tf32_only_in_float32(
    monkeypatch, kept_matmul_precision, native_bf16, dtype, precision
):
    torch.set_float32_matmul_precision("highest")
    fake_gpu(monkeypatch, native_bf16)
    worker = rank_worker(dtype="auto", device="cuda")
    assert (worker.device, worker.dtype) == (CUDA, dtype)
    assert torch.get_float32_matmul_precision() == precision


def test_a_cpu_worker_leaves_float32_matmuls_exact(kept_matmul_precision):
    torch.set_float32_matmul_precision("highest")
    rank_worker(dtype="auto", device="cpu")
    assert torch.get_float32_matmul_precision() == "highest"


# --- LM-head chunk ----------------------------------------------------------------------


def test_chunk_default_follows_the_device():
    assert resolve_chunk_tokens(None, CPU) == CPU_CHUNK_TOKENS == 256
    assert resolve_chunk_tokens(None, CUDA) == CUDA_CHUNK_TOKENS == 4096
    assert resolve_chunk_tokens(96, CUDA) == resolve_chunk_tokens(96, CPU) == 96
    with pytest.raises(ValueError, match="chunk_tokens: must be >= 1, got 0"):
        resolve_chunk_tokens(0, CPU)


def test_run_config_leaves_the_chunk_to_the_device():
    config = RunConfig()
    assert config.actor.logits_chunk_tokens is None
    assert config.reference.logits_chunk_tokens is None


# --- AdamW and DeepSpeed ----------------------------------------------------------------


def _settings(zero_stage: int) -> OptimizerSettings:
    return OptimizerSettings(
        lr=1e-2,
        weight_decay=0.0,
        zero_stage=zero_stage,
        grad_clip=1.0,
        micro_batch_samples=2,
        grad_accum_steps=1,
    )


def test_adamw_is_fused_for_large_weights_and_a_per_tensor_loop_for_small_ones():
    small = [torch.nn.Parameter(torch.zeros(3))]
    large = [torch.nn.Parameter(torch.zeros(LARGE_MODEL_WEIGHT_BYTES // 4))]
    assert adamw(small, _settings(0)).defaults["foreach"] is False
    assert not adamw(small, _settings(0)).defaults["fused"]
    assert adamw(large, _settings(0)).defaults["fused"] is True


@pytest.mark.parametrize(
    ("dtype", "bf16", "fp16"),
    [("float32", False, False), ("bfloat16", True, False), ("float16", False, True)],
)
def test_deepspeed_mixed_precision_follows_the_dtype(dtype, bf16, fp16):
    config = deepspeed_config(2, 4, 1, 1.0, dtype)
    assert (config["bf16"]["enabled"], config["fp16"]["enabled"]) == (bf16, fp16)


def test_deepspeed_config_refuses_an_unresolved_dtype():
    with pytest.raises(ValueError, match=r"dtype: .* got 'auto'; resolve 'auto'.*resolve_dtype"):
        deepspeed_config(0, 4, 1, 1.0, "auto")


@pytest.fixture(scope="module")
def process_group():
    init_process_group(0, 1, "127.0.0.1", free_port())


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_bf16_engine_takes_an_optimizer_step(process_group, tiny_model_dir, zero_stage):
    # The path 'auto' picks on a GPU, on DeepSpeed's CPU accelerator: bf16 weights,
    # float32 master weights and optimizer state inside DeepSpeed.
    model = load_causal_lm(tiny_model_dir, "bfloat16")
    engine = build_training_engine(model, _settings(zero_stage), "bfloat16")
    assert engine.bfloat16_enabled()
    before = full_state_dict(engine)
    ids = torch.randint(4, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    after = full_state_dict(engine)
    assert torch.isfinite(loss)
    assert engine.global_steps == 1
    assert all(tensor.dtype == torch.bfloat16 for tensor in after.values())
    assert all(not torch.equal(before[name], after[name]) for name in before)
    engine.destroy()
