"""A reward model: an HF AutoModelForSequenceClassification (num_labels=1) on CPU.

The score of a sequence is the model's scalar head applied to the hidden state of its
**last real token** (the last position where attention_mask is 1). We take that position
from the mask rather than letting transformers look for the last non-pad id, because in
rlserve's layout (left-padded prompt, right-padded response) the pad id may equal EOS,
which a response legitimately ends with. So the head runs on B hidden states, not B × S.

Supported: decoder-style classifiers with a `score` head over a base model (Llama,
Qwen2, Mistral, Gemma, GPT-2, ... — how reward models are usually built); others are
rejected at load. Positions skip left padding (`last_hidden_state`), so a padded
row scores the same as the row alone. Work is micro-batched (`micro_batch_samples`) and
each micro-batch is trimmed to the columns where any row has a real token; the caller's
deadline is checked between micro-batches.

This module imports transformers, so the engine imports it only when a model kind is
configured: rule/HTTP-only replicas on cheap nodes start without it.
"""

from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from rlserve.core.modeling import DTYPES, last_hidden_state, resolve_dtype
from rlserve.core.serving import Deadline


class RewardModel:
    """Scores token sequences with a sequence-classification reward model."""

    def __init__(self, model_path: str | Path, dtype: str, micro_batch_samples: int) -> None:
        # The model runs on the CPU (this module's docstring).
        loaded = DTYPES[resolve_dtype(dtype, torch.device("cpu"))]
        model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=loaded)
        if model.config.num_labels != 1:
            raise ValueError(
                f"kinds.model.model_path: {model_path} has num_labels="
                f"{model.config.num_labels}; a reward model needs exactly 1"
            )
        head = getattr(model, "score", None)
        base = getattr(model, model.base_model_prefix, None)
        if not isinstance(head, torch.nn.Module) or base is None:
            raise ValueError(
                f"kinds.model.model_path: {type(model).__name__} has no `score` head over a "
                "base model; rlserve scores decoder-style classifiers at the last real token"
            )
        self.model = model.eval()
        self._base = base
        self._head = head
        self.model_path = str(model_path)
        self.micro_batch_samples = micro_batch_samples

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @torch.no_grad()
    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        deadline: Deadline | None = None,
    ) -> torch.Tensor:
        """One score per row at its last real token.

        Shape: input_ids, attention_mask (N, S) int64 -> (N,) float32. Every row must
        have at least one real token.
        """
        scores = []
        for start in range(0, input_ids.shape[0], self.micro_batch_samples):
            if deadline is not None:
                deadline.check("reward model forward")
            ids = input_ids[start : start + self.micro_batch_samples]
            mask = attention_mask[start : start + self.micro_batch_samples]
            ids, mask = _trim_padding(ids, mask)
            hidden = last_hidden_state(self._base, ids, mask)
            positions = torch.arange(mask.shape[1]).expand_as(mask)
            last = (positions * mask).argmax(dim=-1)
            last_hidden = hidden[torch.arange(hidden.shape[0]), last]
            scores.append(self._head(last_hidden).squeeze(-1).float())
        return torch.cat(scores) if scores else torch.zeros(0)


def _trim_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drops leading and trailing columns where no row has a real token."""
    used = mask.any(dim=0).nonzero()
    first, last = int(used[0]), int(used[-1])
    return ids[:, first : last + 1], mask[:, first : last + 1]
