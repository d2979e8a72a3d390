"""The interface every generation engine of the rollout service implements.

Engines work on plain token-id lists, so the same worker code turns their output into
the batch tensors (left-padded prompts, right-padded responses, masks) whichever engine
ran: `hf` (transformers generate) or `vllm` (vLLM in-process).
"""

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingSettings:
    """Validated sampling parameters (from rlserve.v1.SamplingParams)."""

    temperature: float
    """0 = greedy."""
    top_p: float
    """Nucleus mass in (0, 1]; 1 = off."""
    top_k: int
    """-1 = off, else >= 1."""
    max_new_tokens: int
    """Most generated tokens per response."""
    responses_per_prompt: int
    """n >= 1; the n responses of a prompt are adjacent in the output."""
    seed: int | None
    """Sampling seed; None = nondeterministic."""
    ignore_eos: bool
    """Keep generating past EOS (benchmarks)."""
    return_log_probs: bool
    """Also return the engine's log-prob of each sampled token."""
    stop_strings: tuple[str, ...] = ()
    """A response also ends once its text holds one of these (a tool call's closing
    text in a multi-turn rollout); it keeps the tokens that completed it."""


@dataclass(frozen=True)
class Generated:
    """Responses for B prompts × n samples, prompt-major (all n of prompt 0 first)."""

    response_ids: list[list[int]]
    """Token ids per sample, ending with EOS or the token that completed a stop string
    when one was produced; ≤ max_new_tokens."""
    log_probs: list[list[float]] | None
    """Per-token log-probs of response_ids under the sampling distribution, if asked."""


class GenerationEngine(Protocol):
    """What the rollout worker needs from an engine."""

    name: str
    """'hf' or 'vllm'."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingSettings,
        deadline: float | None = None,
    ) -> Generated:
        """Samples sampling.responses_per_prompt responses for each prompt (no padding).

        Once `deadline` (absolute Unix seconds; None = none) has passed, stops between
        tokens and raises DEADLINE_EXCEEDED (rlserve.core.serving.deadline_exceeded)."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copies the actor's weights (HF parameter names) into the engine's own; the
        tensors may be the training module's live parameters, so nothing of them is kept
        after the call."""
        ...

    def sleep(self) -> None:
        """Frees what the engine can give up while the actor trains (or does nothing)."""
        ...

    def wake_weights(self) -> None:
        """Undoes `sleep` for the weights only (a no-op when they are awake); required
        before load_weights."""
        ...

    def wake_up(self) -> None:
        """Undoes `sleep` entirely (a no-op when awake); required before generate."""
        ...
