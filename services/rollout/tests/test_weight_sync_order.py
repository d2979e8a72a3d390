"""The vLLM engine's sleep and the weight sync after an update, in the order that keeps
one GPU's peak low (issue 30, defect 1), on CPU.

Sleep mode needs the CUDA build of vLLM, so vLLM's `LLM` is replaced by a stub that
records what the engine asks of it (and consumes the weights it is sent), vLLM's
platform is faked as a GPU one, and `torch.cuda.empty_cache` records its calls. The
rest is real: the ActorWorker (DeepSpeed world size 1, gloo, no Ray) and the
VLLMGenerationEngine between them.
"""

from __future__ import annotations

import functools
import weakref
from types import SimpleNamespace

import pytest
import torch

import rlserve.rollout.vllm_engine as vllm_engine
import rlserve.rollout.worker as worker_module
from rlserve.core.batch import Batch
from rlserve.core.cluster import free_port
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.rollout.generation import SamplingSettings
from rlserve.rollout.worker import ActorWorker, actor_worker_kwargs

GREEDY = SamplingSettings(
    temperature=0.0,
    top_p=1.0,
    top_k=-1,
    max_new_tokens=2,
    responses_per_prompt=1,
    seed=None,
    ignore_eos=False,
    return_log_probs=False,
)


class RecordingLLM:
    """Stands in for vllm.LLM: logs sleep/wake/weight-load calls, keeps no weights."""

    def __init__(self, log: list, **settings):
        self.log, self.settings = log, settings
        self.sleeping: set[str] = set()
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))

    def generate(self, *args, **kwargs) -> list:
        return []

    def sleep(self, level: int) -> None:
        self.log.append(("sleep", level))
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str]) -> bool:
        self.log.append(("wake_up", *tags))
        self.sleeping -= set(tags)
        return not self.sleeping

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        names = [name for name, _ in kwargs["weights_iterator"]]
        self.log.append((method, len(names)))

    def reset_prefix_cache(self) -> bool:
        return True


@pytest.fixture
def log(monkeypatch) -> list:
    """What vLLM and torch.cuda were asked, in order; vLLM's platform faked as a GPU."""
    calls: list = []
    monkeypatch.setattr(vllm_engine, "LLM", functools.partial(RecordingLLM, calls))
    gpu = SimpleNamespace(
        is_sleep_mode_available=lambda: True, is_cpu=lambda: False, device_type="cuda"
    )
    monkeypatch.setattr(vllm_engine, "current_platform", gpu)
    # A real engine of another test module may still be alive: one per process applies
    # to real engines, not to these.
    monkeypatch.setattr(vllm_engine, "_LIVE_ENGINES", weakref.WeakSet())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    return calls


def make_worker(model_dir, **settings) -> ActorWorker:
    config = RolloutServiceConfig(
        model_path=str(model_dir),
        engine="vllm",
        vllm={"sleep_while_training": True},
        ppo_mini_batch_samples=4,
        micro_batch_samples=2,
        **settings,
    )
    worker = ActorWorker(rank=0, world_size=1, **actor_worker_kwargs(config))
    worker.init_distributed("127.0.0.1", free_port())
    return worker


def update_batch() -> Batch:
    """Four rows of 3 prompt + 3 response tokens, advantage 1 everywhere."""
    prompts = torch.tensor([[1, 21, 15], [1, 23, 24], [1, 40, 41], [1, 50, 51]])
    responses = torch.tensor([[22, 33, 2], [24, 25, 2], [42, 43, 2], [52, 53, 2]])
    mask = torch.ones_like(responses)
    return Batch(
        {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.ones(4, 6, dtype=torch.long),
            "responses": responses,
            "response_mask": mask,
            "advantages": mask.float(),
        }
    )


def test_update_wakes_weights_then_loads_then_empties_the_cache_then_wakes_kv(log, tiny_model_dir):
    worker = make_worker(tiny_model_dir)
    log.clear()  # construction's calls are not the update's
    worker.update_actor(update_batch())
    weight_count = len(worker.policy_weights())
    assert log == [
        ("sleep", 2),  # level 2: the sync overwrites the weights, no host copy of them
        ("empty_cache",),  # training's cached blocks back to the driver
        ("wake_up", "weights"),
        ("reload_weights", weight_count),
        ("empty_cache",),
        ("wake_up", "kv_cache"),
    ]
    assert not worker.generation.asleep


def test_the_training_copy_is_released_before_the_kv_cache_wakes(log, tiny_model_dir, monkeypatch):
    """With LoRA the sync computes merged weights, a new tensor per adapted layer: all
    of them must be unreferenced when torch's cache is emptied for the KV cache."""
    sent: list[weakref.ref] = []

    def merged_and_watched(module):
        weights = merged_state_dict(module)
        sent.extend(weakref.ref(tensor) for tensor in weights.values())
        return weights

    merged_state_dict = worker_module.merged_state_dict
    monkeypatch.setattr(worker_module, "merged_state_dict", merged_and_watched)
    worker = make_worker(tiny_model_dir, lora_rank=4)
    worker.update_actor(update_batch())

    alive_at: dict[str, int] = {}

    def record_alive(*call) -> None:
        log.append(call)
        alive_at[" ".join(map(str, call))] = sum(ref() is not None for ref in sent)

    sent.clear()
    log.clear()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: record_alive("empty_cache"))
    llm = worker.generation.llm
    monkeypatch.setattr(llm, "collective_rpc", lambda method, kwargs: record_alive(method))
    worker.update_actor(update_batch())

    assert sent, "the sync never computed merged weights"
    assert alive_at["reload_weights"] == len(sent)  # held while they are copied
    assert log[-2:] == [("empty_cache",), ("wake_up", "kv_cache")]
    assert alive_at["empty_cache"] == 0, "merged weights still referenced as the KV cache wakes"


def test_generation_is_refused_until_weights_are_loaded_after_a_sleep(log, tiny_model_dir):
    """Level 2 discards the weights: waking them gives memory, not the old weights."""
    engine = vllm_engine.VLLMGenerationEngine(str(tiny_model_dir), sleep_while_training=True)
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake_weights"):
        engine.load_weights({})
    engine.wake_up()
    with pytest.raises(RuntimeError, match=r"discarded by sleep .*\(load_weights\)"):
        engine.generate([[1, 2]], GREEDY)
    assert log[-2:] == [("empty_cache",), ("wake_up", "kv_cache")]


def test_cuda_graphs_by_default_on_a_gpu(log, tiny_model_dir):
    """Issue 30, defect 7: enforce_eager None means CUDA graphs off CPU (eager on CPU:
    test_vllm_engine); an explicit setting wins."""
    default = vllm_engine.VLLMGenerationEngine(str(tiny_model_dir))
    assert default.llm.settings["enforce_eager"] is False
    del default
    eager = vllm_engine.VLLMGenerationEngine(str(tiny_model_dir), enforce_eager=True)
    assert eager.llm.settings["enforce_eager"] is True
