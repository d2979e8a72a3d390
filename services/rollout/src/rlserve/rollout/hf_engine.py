"""The 'hf' generation engine: transformers `generate` on the policy's weights.

Choices:
- Two ways to hold the weights. By default the engine loads its own copy (eval mode, no
  grad) and `load_weights` copies the actor's weights in after each update. Given the
  training module itself (`shared_model`, which the rollout worker passes when the
  module holds whole plain weights: ZeRO stage 0-2, no LoRA) it generates with that
  module in eval mode and holds no second copy: one model's worth of memory less, and
  no weight sync.
- Prompts are left-padded into one batch and each is repeated n times up front (prompt
  major), so greedy decoding with n > 1 works too (transformers refuses
  num_return_sequences > 1 without sampling) and the KV cache serves the whole batch.
- Sampling: temperature, then top-k, then top-p (transformers' processor order, as in
  vLLM). A seeded call runs under a forked RNG, so it is reproducible and leaves the
  process's global RNG untouched.
- Log-probs are those of the sampled token under softmax(logits / T), the temperature-
  scaled distribution before top-k/top-p truncation (T = 1 when greedy): exactly what
  ComputeLogProb computes from a full forward pass, so the two agree (≈ 1e-6 in fp32).
  They are taken step by step (SampledLogProbs, a forward hook), not from transformers'
  `output_logits`, which keeps every step's fp32 logits, [rows, steps, vocab], to the end.
- A response ends with the first EOS when the request stops at EOS, or with the token
  that completed one of its stop strings (transformers' StopStringCriteria); after a row
  finishes, transformers fills it with the pad id, which is cut off here.
- Deadline: a stopping criterion ends every row once the caller's deadline has passed
  (checked after each token step), and `generate` then raises DEADLINE_EXCEEDED instead
  of returning the cut responses. The prompts' prefill is one forward pass and is not
  interrupted.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from rlserve.core.modeling import load_causal_lm, load_tokenizer, resolve_dtype
from rlserve.core.serving import Deadline, deadline_exceeded
from rlserve.rollout.generation import Generated, SamplingSettings


class DeadlineStop(StoppingCriteria):
    """Stops every row once `deadline` (absolute Unix seconds) has passed; `passed`
    then tells the caller to raise instead of returning the cut responses."""

    def __init__(self, deadline: float):
        self.deadline = Deadline(deadline)
        self.passed = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.passed = self.passed or self.deadline.remaining_s() <= 0
        return torch.full(
            (input_ids.shape[0],), self.passed, dtype=torch.bool, device=input_ids.device
        )


class SampledLogProbs:
    """The sampled tokens' log-probs under softmax(logits / T), one decoding step at a time.

    A forward hook on the model turns each forward's last-position logits into log-probs
    [rows, vocab] and holds them only until the next forward, whose input is the token
    just sampled from them; that token's entry, [rows], is all that is kept. Peak: one
    step's [rows, vocab], whatever the number of steps. The hook sees the logits before
    any logits processor (top-k/top-p masks come after), as transformers does.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: torch.Tensor | None = None
        self.picked: list[torch.Tensor] = []

    @contextmanager
    def recording(self, model: torch.nn.Module):
        handle = model.register_forward_hook(self._after_forward, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    def _after_forward(self, module, args, kwargs, output) -> None:
        if self.pending is not None:
            self._pick(kwargs["input_ids"][:, -1])
        logits = output.logits[:, -1].float() / self.temperature
        self.pending = torch.log_softmax(logits, dim=-1)

    def _pick(self, tokens: torch.Tensor) -> None:
        self.picked.append(self.pending.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
        self.pending = None

    def of(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[rows, steps] log-probs of `new_tokens` [rows, steps], the generated ids."""
        steps = new_tokens.shape[1]
        if len(self.picked) < steps:  # the last step's token never entered a forward
            self._pick(new_tokens[:, len(self.picked)])
        if len(self.picked) < steps:
            raise RuntimeError(f"recorded {len(self.picked)} decoding steps, expected {steps}")
        return torch.stack(self.picked[:steps], dim=1)


class HFGenerationEngine:
    """transformers causal LM + KV cache, batched with left padding."""

    name = "hf"

    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        device: torch.device | None = None,
        shared_model: torch.nn.Module | None = None,
    ):
        self.device = device or torch.device("cpu")
        self.shares_weights = shared_model is not None
        if shared_model is None:
            loaded = resolve_dtype(dtype, self.device)
            self.model = load_causal_lm(model_path, loaded).to(self.device).eval()
            self.model.requires_grad_(False)
        else:
            self.model = shared_model
        tokenizer = load_tokenizer(model_path)
        self.tokenizer = tokenizer
        self.pad_token_id: int = tokenizer.pad_token_id
        self.eos_token_ids: frozenset[int] = _eos_token_ids(self.model, tokenizer)
        # transformers fills every setting a call leaves None from the model's
        # generation_config.json (a checkpoint may ship top_k, repetition_penalty, EOS...);
        # a neutral one makes each request's SamplingSettings the whole story.
        self.neutral_generation_config = GenerationConfig(pad_token_id=self.pad_token_id)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingSettings,
        deadline: float | None = None,
    ) -> Generated:
        """Samples sampling.responses_per_prompt responses for each prompt (no padding);
        DEADLINE_EXCEEDED within a token step once `deadline` (Unix seconds) passes."""
        Deadline(deadline).check("GenerateSequences")
        if not prompt_ids:
            return Generated(response_ids=[], log_probs=[] if sampling.return_log_probs else None)
        n = sampling.responses_per_prompt
        rows = [ids for ids in prompt_ids for _ in range(n)]
        input_ids, attention_mask = self._left_pad(rows)
        greedy = sampling.temperature == 0
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            # Sampling only: 0 and 1.0 switch top-k/top-p off (None would mean transformers'
            # default top_k 50); greedy ignores them, and setting them would only warn.
            temperature=None if greedy else sampling.temperature,
            top_k=None if greedy else max(sampling.top_k, 0),
            top_p=None if greedy else sampling.top_p,
            eos_token_id=None if sampling.ignore_eos else sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            use_cache=True,
        )
        stop = None if deadline is None else DeadlineStop(deadline)
        criteria = [stop] if stop else []
        if sampling.stop_strings:
            criteria.append(StopStringCriteria(self.tokenizer, list(sampling.stop_strings)))
        cuda_devices = [self.device.index or 0] if self.device.type == "cuda" else []
        recorder = SampledLogProbs(1.0 if greedy else sampling.temperature)
        with (
            self._inference_mode(),
            torch.random.fork_rng(devices=cuda_devices, enabled=sampling.seed is not None),
            recorder.recording(self.model) if sampling.return_log_probs else nullcontext(),
        ):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
                stopping_criteria=StoppingCriteriaList(criteria),
            )
        if stop is not None and stop.passed:
            raise deadline_exceeded("GenerateSequences")
        new_tokens = output.sequences[:, input_ids.shape[1] :]
        host_tokens = new_tokens.cpu()
        lengths = self._response_lengths(host_tokens, stop_at_eos=not sampling.ignore_eos)
        if sampling.stop_strings:
            lengths = [
                self._stop_string_length(row[:length].tolist(), sampling.stop_strings)
                for row, length in zip(host_tokens, lengths, strict=True)
            ]
        response_ids = [
            row[:length].tolist() for row, length in zip(host_tokens, lengths, strict=True)
        ]
        log_probs = None
        if sampling.return_log_probs:
            picked = recorder.of(new_tokens).cpu()
            log_probs = [row[:length].tolist() for row, length in zip(picked, lengths, strict=True)]
        return Generated(response_ids=response_ids, log_probs=log_probs)

    @contextmanager
    def _inference_mode(self):
        """Eval mode and the neutral generation config for one call; a shared training
        module gets its mode and config back (its config is saved with checkpoints)."""
        was_training, saved_config = self.model.training, self.model.generation_config
        self.model.eval()
        self.model.generation_config = self.neutral_generation_config
        try:
            yield
        finally:
            self.model.generation_config = saved_config
            self.model.train(was_training)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copies the actor's weights in (HF parameter names; tied weights may be absent).
        With a shared model there is nothing to copy: the weights are the actor's own."""
        if self.shares_weights:
            return
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if unexpected:
            raise ValueError(f"weights not in the generation model: {sorted(unexpected)[:5]}")
        # A tied weight (e.g. lm_head = embeddings) shares storage with a loaded one.
        own = self.model.state_dict()
        loaded = {own[k].data_ptr() for k in state_dict}
        untied = [k for k in missing if own[k].data_ptr() not in loaded]
        if untied:
            raise ValueError(f"weights missing for the generation model: {sorted(untied)[:5]}")

    def sleep(self) -> None:
        """Nothing to free: the KV cache lives only during a generate call."""

    def wake_weights(self) -> None:
        """Nothing to restore (see sleep)."""

    def wake_up(self) -> None:
        """Nothing to restore (see sleep)."""

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            if ids:
                input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention_mask[i, width - len(ids) :] = 1
        return input_ids, attention_mask

    def _response_lengths(self, new_tokens: torch.Tensor, stop_at_eos: bool) -> list[int]:
        """Tokens per row up to and including the first EOS (all of them without EOS)."""
        width = new_tokens.shape[1]
        if not stop_at_eos or width == 0:
            return [width] * new_tokens.shape[0]
        is_eos = torch.isin(new_tokens, torch.tensor(sorted(self.eos_token_ids)))
        # argmax finds the first True; rows without EOS ran the full width (unfinished rows
        # have no pad fill: generation stops only when every row has finished).
        first = is_eos.int().argmax(dim=1)
        return [
            int(f) + 1 if has else width for f, has in zip(first, is_eos.any(dim=1), strict=True)
        ]

    def _stop_string_length(self, ids: list[int], stop_strings: tuple[str, ...]) -> int:
        """Tokens up to and including the one that completed a stop string (all of
        them without one): a row that stopped so is followed by pad ids."""
        for length in range(1, len(ids) + 1):
            # the text as vLLM checks it too: without special tokens
            text = self.tokenizer.decode(ids[:length], skip_special_tokens=True)
            if any(stop in text for stop in stop_strings):
                return length
        return len(ids)


def _eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    """The model's generation EOS ids (some chat models have several), else the tokenizer's."""
    configured = model.generation_config.eos_token_id
    if configured is None:
        configured = tokenizer.eos_token_id
    if configured is None:
        raise ValueError("the model and its tokenizer define no EOS token")
    return frozenset([configured] if isinstance(configured, int) else configured)
