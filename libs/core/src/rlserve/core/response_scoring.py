"""Log-probs and entropy of response tokens with memory bounded by a token chunk.

A causal LM's logits over the whole sequence cost batch × seq × vocab floats: for a
135 M model with a 49k vocabulary, a micro-batch of 64 × 112 tokens is 1.4 GB in
float32, and an entropy computed from it several times that. Scoring needs only the
response positions, so this module:

1. trims the micro-batch to the columns some row uses (left padding of the prompts,
   response columns past the longest response), so nothing is computed for padding;
2. runs the model's backbone (its `base_model`) once for hidden states;
3. keeps the hidden states of real response tokens only ([tokens, hidden]);
4. applies the LM head `chunk_tokens` rows at a time (by default 256 on the CPU, 4096 on
   CUDA: `resolve_chunk_tokens`), and from each chunk's logits takes
   the label's log-prob (`z[y] - logsumexp z`) and the entropy
   (`logsumexp z - Σ softmax(z)·z`, the dot product as a matmul: no product copy).

Peak extra memory is ≈ 3 × chunk_tokens × vocab floats, whatever the batch and sequence.
With gradients on, each chunk's head + loss runs under activation checkpointing, so
backward recomputes a chunk's logits instead of keeping every chunk alive.

One exception: training under ZeRO-3. Its hooks gather partitioned weights and reduce
their gradients correctly only for work inside the engine's own forward (calling the
backbone and head as submodules trained wrong weights in a test), so there the model's
forward computes the logits of the response positions in one piece (`logits_to_keep`),
and only the log-softmax and entropy are chunked. Inference under ZeRO-3 chunks as usual.

Models whose logits are not the plain head output say so in their config: Gemma-style
`final_logit_softcapping` and Cohere-style `logit_scale` are applied here; others use the
head as is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from rlserve.core.batch import Batch
from rlserve.core.lora import is_lora
from rlserve.core.modeling import position_ids_from_mask

CPU_CHUNK_TOKENS = 256
"""LM-head chunk on the CPU: 3 × 256 × a 49k vocabulary is 150 MB of float32 logits."""
CUDA_CHUNK_TOKENS = 4096
"""LM-head chunk on a GPU: matmuls large enough to keep it busy (hundreds of 256-row
ones are mostly launch overhead); 3 × 4096 × a 152k vocabulary is 7.5 GB of float32
logits, so set logits_chunk_tokens lower where that memory is not free."""


def resolve_chunk_tokens(setting: int | None, device: torch.device) -> int:
    """Response tokens per LM-head chunk on `device` for a `logits_chunk_tokens` setting:
    the setting, or None for the device's default (CUDA_CHUNK_TOKENS on CUDA, else
    CPU_CHUNK_TOKENS)."""
    if setting is not None:
        if setting < 1:
            raise ValueError(f"chunk_tokens: must be >= 1, got {setting}")
        return setting
    return CUDA_CHUNK_TOKENS if device.type == "cuda" else CPU_CHUNK_TOKENS


@dataclass(frozen=True)
class ResponseScores:
    """Per-token results laid out like `responses`: 0 where response_mask is 0."""

    log_probs: torch.Tensor
    """log π(token), float32. Shape: (B, R)"""
    entropy: torch.Tensor | None
    """Entropy of π at each response position in nats, float32, or None when not asked
    for. Shape: (B, R)"""
    sum_pi_squared: torch.Tensor | None = None
    """Σ_v π(v)² over the vocabulary at each response position (the optimal token
    baseline's variance proxy), float32, or None when not asked for. Shape: (B, R)"""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside a DeepSpeed engine (its `.module`) and a peft
    model (its base, adapters still active), or `model` itself."""
    inner = getattr(model, "module", None)
    model = inner if isinstance(inner, torch.nn.Module) else model
    return model.get_base_model() if is_lora(model) else model


def trim_padding(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Drops columns no row uses: leading all-pad prompt columns and trailing response
    columns past the longest response. Positions come from the mask, so the kept tokens
    see exactly what they saw before.

    Shape: input_ids, attention_mask (B, P+R), response_mask (B, R)
        -> input_ids, attention_mask (B, P'+R'), R'
    """
    response_len = response_mask.shape[1]
    prompt_len = input_ids.shape[1] - response_len
    used_prompt = attention_mask[:, :prompt_len].any(dim=0)
    first = int(used_prompt.long().argmax()) if bool(used_prompt.any()) else prompt_len
    used_response = response_mask.any(dim=0)
    kept_response = int(used_response.nonzero().max()) + 1 if bool(used_response.any()) else 0
    end = prompt_len + kept_response
    return input_ids[:, first:end], attention_mask[:, first:end], kept_response


def forward_micro_batches(
    batch: Batch, max_samples: int, max_tokens: int | None = None
) -> Iterator[Batch]:
    """Consecutive row slices of a sequence batch, each at most `max_samples` rows and,
    with `max_tokens`, at most that many tokens once trimmed (rows × (longest prompt +
    longest response) in the slice): a few long sequences make a small micro-batch, many
    short ones a large one. A single row longer than `max_tokens` goes alone.
    """
    if max_tokens is None:
        yield from batch.chunk(max_samples)
        return
    response_mask = batch["response_mask"]
    prompt_len = batch["input_ids"].shape[1] - response_mask.shape[1]
    prompt_lengths = batch["attention_mask"][:, :prompt_len].sum(dim=1).tolist()
    response_lengths = response_mask.sum(dim=1).tolist()
    start = 0
    while start < len(batch):
        longest_prompt = longest_response = 0
        end = start
        while end < len(batch) and end - start < max_samples:
            prompt = max(longest_prompt, int(prompt_lengths[end]))
            response = max(longest_response, int(response_lengths[end]))
            if end > start and (end - start + 1) * (prompt + response) > max_tokens:
                break
            longest_prompt, longest_response = prompt, response
            end += 1
        yield batch.index(slice(start, end))
        start = end


def _zero3_training(model: torch.nn.Module) -> bool:
    """A DeepSpeed ZeRO-3 engine computing with gradients."""
    stage = getattr(model, "zero_optimization_stage", None)
    return callable(stage) and stage() == 3 and torch.is_grad_enabled()


def _logit_transform(config: object) -> tuple[float | None, float | None]:
    """(logit_scale, final_logit_softcapping) the model applies after its head."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (
        getattr(text_config, "logit_scale", None),
        getattr(text_config, "final_logit_softcapping", None),
    )


def _chunk_scores(
    features: torch.Tensor,
    labels: torch.Tensor,
    head: torch.nn.Module | None,
    temperature: float,
    logit_scale: float | None,
    softcap: float | None,
    with_entropy: bool,
    with_sum_pi_squared: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log-prob of each label, entropy and Σπ², for one chunk of hidden states (or,
    with no head, of logits the model already computed and post-processed). Σπ², and
    the entropy unless `entropy_grad`, come from detached logits: no graph, and under
    checkpointing backward's recomputation stops before them.

    Shape: features (n, H) or (n, V), labels (n,) -> (n,), (n,), (n,) (entropy and Σπ²
    are empty when not asked for)
    """
    logits = features.float()
    if head is not None:
        logits = head(features).float()
        if logit_scale is not None:
            logits = logits * logit_scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        # Sampling used logits / T; scoring with the same T keeps ratios on-policy.
        logits = logits / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - normaliser
    entropy = sum_pi_squared = logits.new_zeros(0)
    if not (with_entropy or with_sum_pi_squared):
        return log_probs, entropy, sum_pi_squared
    if not entropy_grad:
        logits, normaliser = logits.detach(), normaliser.detach()
    probs = torch.softmax(logits, dim=-1)
    if with_entropy:
        # Σ p·z as a batched dot product: a matmul allocates no (n, V) product.
        expected_logit = (probs.unsqueeze(-2) @ logits.unsqueeze(-1)).reshape(-1)
        entropy = normaliser - expected_logit
    if with_sum_pi_squared:
        probs = probs.detach()
        sum_pi_squared = (probs.unsqueeze(-2) @ probs.unsqueeze(-1)).reshape(-1)
    return log_probs, entropy, sum_pi_squared


def score_responses(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    entropy_grad: bool = True,
) -> ResponseScores:
    """log π(response token) (and entropy, and Σ_v π(v)²) at every real response token.

    `model` is a Hugging Face causal LM or a DeepSpeed engine around one. Differentiable
    when grad is enabled: the log-probs, and the entropy unless `entropy_grad` is False
    (a metric only: cheaper, backward recomputes nothing for it). Σπ² never is.
    `chunk_tokens`: rows per LM-head chunk, None = the device's (resolve_chunk_tokens).

    Shape: input_ids, attention_mask (B, P+R); responses, response_mask (B, R)
        -> ResponseScores of (B, R)
    """
    chunk_tokens = resolve_chunk_tokens(chunk_tokens, input_ids.device)
    causal_lm = unwrap_model(model)
    batch_size, response_len = responses.shape
    mask = response_mask.bool()
    ids, attention, kept = trim_padding(input_ids, attention_mask, response_mask)
    log_probs = torch.zeros(batch_size, response_len, dtype=torch.float32, device=ids.device)
    entropy = torch.zeros_like(log_probs) if with_entropy else None
    sum_pi_squared = torch.zeros_like(log_probs) if with_sum_pi_squared else None
    if kept == 0:
        return ResponseScores(log_probs, entropy, sum_pi_squared)
    position_ids = position_ids_from_mask(attention)
    # Position P'+t-1 predicts response token t; keep real response tokens only.
    kept_mask = mask[:, :kept]
    token_labels = responses[:, :kept][kept_mask]
    if _zero3_training(model):
        # ZeRO-3 gathers partitioned weights for, and reduces the gradients of, what runs
        # inside the engine's own forward: the whole model, logits for the response
        # positions only (logits_to_keep), the head in one piece.
        logits = model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=kept + 1,
        ).logits
        features = logits[:, :-1][kept_mask]
        head, logit_scale, softcap = None, None, None
    else:
        hidden = causal_lm.base_model(
            input_ids=ids, attention_mask=attention, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        features = hidden[:, -kept - 1 : -1][kept_mask]
        head = causal_lm.get_output_embeddings()
        logit_scale, softcap = _logit_transform(causal_lm.config)
    picked, entropies, squares = [], [], []
    for start in range(0, features.shape[0], chunk_tokens):
        args = (
            features[start : start + chunk_tokens],
            token_labels[start : start + chunk_tokens],
            head,
            temperature,
            logit_scale,
            softcap,
            with_entropy,
            with_sum_pi_squared,
            entropy_grad,
        )
        if torch.is_grad_enabled() and head is not None:
            chunk = checkpoint(_chunk_scores, *args, use_reentrant=False)
        else:
            chunk = _chunk_scores(*args)
        picked.append(chunk[0])
        entropies.append(chunk[1])
        squares.append(chunk[2])
    # index_put keeps the graph: the zeros outside the mask carry no gradient.
    log_probs = log_probs.index_put((mask.nonzero(as_tuple=True)), torch.cat(picked))
    if with_entropy:
        entropy = entropy.index_put((mask.nonzero(as_tuple=True)), torch.cat(entropies))
    if with_sum_pi_squared:
        positions = mask.nonzero(as_tuple=True)
        sum_pi_squared = sum_pi_squared.index_put(positions, torch.cat(squares).detach())
    return ResponseScores(log_probs, entropy, sum_pi_squared)
