"""Response-only chunked log-probs/entropy against the plain full-logits computation."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from rlserve.core.algos.aggregation import entropy_from_logits
from rlserve.core.modeling import log_probs_from_logits, response_logits
from rlserve.core.response_scoring import score_responses, trim_padding


def tiny_lm(
    vocab_size: int = 97, hidden_size: int = 32, seed: int = 0, **extra
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def ragged_batch(
    vocab_size: int, prompt_lens: list[int], response_lens: list[int], width_p: int, width_r: int
) -> dict[str, torch.Tensor]:
    """Left-padded prompts then right-padded responses, as the rollout lays them out."""
    generator = torch.Generator().manual_seed(1)
    rows = len(prompt_lens)
    prompts = torch.zeros(rows, width_p, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.long)
    responses = torch.zeros(rows, width_r, dtype=torch.long)
    response_mask = torch.zeros(rows, width_r, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompts[row, width_p - p :] = torch.randint(1, vocab_size, (p,), generator=generator)
        prompt_mask[row, width_p - p :] = 1
        responses[row, :r] = torch.randint(1, vocab_size, (r,), generator=generator)
        response_mask[row, :r] = 1
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "responses": responses,
        "response_mask": response_mask,
    }


def padded_logits(model, batch, temperature: float) -> torch.Tensor:
    """[B, R, V] logits of every response position of the padded batch."""
    return response_logits(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        batch["responses"].shape[1],
        temperature,
    )


def full_logits_reference(model, batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The obvious version: [B, R, V] logits over the padded batch, then mask."""
    logits = padded_logits(model, batch, temperature)
    mask = batch["response_mask"].bool()
    log_probs = torch.where(mask, log_probs_from_logits(logits, batch["responses"]), 0.0)
    entropy = torch.where(mask, entropy_from_logits(logits.float()), 0.0)
    return log_probs, entropy


LAYOUTS = {
    "uneven prompts and responses": ([3, 7, 5, 1], [4, 1, 6, 2], 9, 8),
    "one row with no response": ([4, 4, 2], [5, 0, 3], 6, 6),
    "every response full width": ([5, 2], [6, 6], 5, 6),
    "single row": ([6], [3], 6, 5),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_scores_equal_full_logits(layout, chunk_tokens, temperature):
    model = tiny_lm()
    batch = ragged_batch(97, *layout)
    expected_log_probs, expected_entropy = full_logits_reference(model, batch, temperature)
    with torch.no_grad():
        scores = score_responses(
            model, **batch, temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=True
        )
    torch.testing.assert_close(scores.log_probs, expected_log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.entropy, expected_entropy, atol=1e-5, rtol=0)
    # Outside the mask both are exactly zero.
    outside = ~batch["response_mask"].bool()
    assert torch.all(scores.log_probs[outside] == 0)
    assert torch.all(scores.entropy[outside] == 0)


def test_without_entropy_returns_none_and_same_log_probs():
    model = tiny_lm()
    batch = ragged_batch(97, *LAYOUTS["uneven prompts and responses"])
    with torch.no_grad():
        with_entropy = score_responses(model, **batch, chunk_tokens=4, with_entropy=True)
        without = score_responses(model, **batch, chunk_tokens=4)
    assert without.entropy is None
    assert torch.equal(without.log_probs, with_entropy.log_probs)


def test_gradients_equal_the_full_logits_gradients():
    """Checkpointed chunks give the same parameter gradients as the plain computation."""
    batch = ragged_batch(97, *LAYOUTS["uneven prompts and responses"])
    weights = torch.linspace(-1, 1, batch["responses"].numel()).reshape(batch["responses"].shape)

    def grads(use_chunks: bool) -> dict[str, torch.Tensor]:
        model = tiny_lm()
        if use_chunks:
            scores = score_responses(model, **batch, chunk_tokens=3, with_entropy=True)
            log_probs, entropy = scores.log_probs, scores.entropy
        else:
            log_probs, entropy = full_logits_reference(model, batch, 1.0)
        ((log_probs * weights).sum() + 0.1 * entropy.sum()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    chunked, plain = grads(True), grads(False)
    assert chunked.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(chunked[name], plain[name], atol=1e-5, rtol=1e-4, msg=name)


def test_an_entropy_without_grad_is_the_same_metric_and_leaves_the_log_prob_gradients():
    """entropy_grad=False: the entropy's values are unchanged, it carries no graph, and
    the log-probs' gradients are those of the plain computation."""
    batch = ragged_batch(97, *LAYOUTS["uneven prompts and responses"])
    weights = torch.linspace(-1, 1, batch["responses"].numel()).reshape(batch["responses"].shape)

    def scored(entropy_grad: bool):
        model = tiny_lm()
        scores = score_responses(
            model, **batch, chunk_tokens=3, with_entropy=True, entropy_grad=entropy_grad
        )
        (scores.log_probs * weights).sum().backward()
        return scores, {name: p.grad.clone() for name, p in model.named_parameters()}

    (metric_only, grads), (with_graph, reference_grads) = scored(False), scored(True)
    assert not metric_only.entropy.requires_grad and with_graph.entropy.requires_grad
    torch.testing.assert_close(metric_only.entropy, with_graph.entropy.detach())
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_logit_softcapping_and_scale_are_applied():
    """A config that post-processes the head's logits is scored like the model's own
    forward (which applies them)."""

    class ScaledLlama(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = torch.tanh(output.logits * 2.0 / 5.0) * 5.0
            return output

    model = tiny_lm(seed=3)
    model.config.logit_scale = 2.0
    model.config.final_logit_softcapping = 5.0
    scaled = ScaledLlama(model.config).eval()
    scaled.load_state_dict(model.state_dict())
    batch = ragged_batch(97, *LAYOUTS["uneven prompts and responses"])
    expected_log_probs, expected_entropy = full_logits_reference(scaled, batch, 1.0)
    with torch.no_grad():
        scores = score_responses(scaled, **batch, chunk_tokens=5, with_entropy=True)
    torch.testing.assert_close(scores.log_probs, expected_log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.entropy, expected_entropy, atol=1e-5, rtol=0)


def test_trim_padding_drops_only_unused_columns():
    batch = ragged_batch(97, [2, 3], [1, 4], 6, 7)
    ids, attention, kept = trim_padding(
        batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    )
    assert kept == 4  # the longest response
    assert ids.shape == (2, 3 + 4)  # the longest prompt + the longest response
    assert torch.equal(ids, batch["input_ids"][:, 3:10])
    assert torch.equal(attention.sum(dim=1), batch["attention_mask"].sum(dim=1))


def test_chunk_tokens_must_be_positive():
    batch = ragged_batch(97, [2], [2], 2, 2)
    with pytest.raises(ValueError, match="chunk_tokens"):
        score_responses(tiny_lm(), **batch, chunk_tokens=0)


def peak_tensor_bytes(fn) -> int:
    """Most bytes of tensors alive at once while fn runs (torch's allocator events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda event: event.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_memory_does_not_grow_with_vocab_times_tokens():
    """50k vocabulary, 32 rows × 48 response tokens: the full float32 logits alone would
    be 300 MB; the chunked path must stay a small fraction of that."""
    vocab = 50_000
    model = tiny_lm(vocab_size=vocab, hidden_size=16)
    batch = ragged_batch(vocab, [16] * 32, [48] * 32, 16, 48)
    full_logits_bytes = 32 * 48 * vocab * 4

    def chunked():
        with torch.no_grad():
            score_responses(model, **batch, chunk_tokens=128, with_entropy=True)

    def plain():
        with torch.no_grad():
            full_logits_reference(model, batch, 1.0)

    chunked_peak, plain_peak = peak_tensor_bytes(chunked), peak_tensor_bytes(plain)
    print(
        f"peak tensor bytes: chunked {chunked_peak / 2**20:.1f} MiB, plain "
        f"{plain_peak / 2**20:.1f} MiB, full logits {full_logits_bytes / 2**20:.1f} MiB"
    )
    assert plain_peak >= full_logits_bytes  # the measurement sees the big tensor
    # ≈ 3 chunk-sized (128 × 50k) float32 tensors: 77 MB, a quarter of the full logits.
    assert chunked_peak < 4 * 128 * vocab * 4
    assert chunked_peak < full_logits_bytes / 3


def test_forward_micro_batches_cap_samples_and_tokens():
    from rlserve.core.batch import Batch
    from rlserve.core.response_scoring import forward_micro_batches

    # prompt lengths 2,2,2,8,2 and response lengths 2,2,2,8,2 in a P=8, R=8 layout
    tensors = ragged_batch(97, [2, 2, 2, 8, 2], [2, 2, 2, 8, 2], 8, 8)
    batch = Batch(tensors)
    by_samples = [len(m) for m in forward_micro_batches(batch, max_samples=2)]
    assert by_samples == [2, 2, 1]
    # 16 tokens: three short rows (3 × 4 = 12) fit, the long row (1 × 16) goes alone
    sizes = [len(m) for m in forward_micro_batches(batch, max_samples=64, max_tokens=16)]
    assert sizes == [3, 1, 1]
    # a budget below one long row still makes progress: that row goes alone
    sizes = [len(m) for m in forward_micro_batches(batch, max_samples=64, max_tokens=5)]
    assert sizes == [1, 1, 1, 1, 1]
    rows = torch.cat([m["input_ids"] for m in forward_micro_batches(batch, 64, 16)])
    assert torch.equal(rows, batch["input_ids"])  # order kept, nothing lost


@pytest.mark.parametrize("chunk_tokens", [1, 3, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sum_pi_squared_equals_the_full_softmax(chunk_tokens, temperature):
    model = tiny_lm()
    batch = ragged_batch(97, *LAYOUTS["uneven prompts and responses"])
    logits = padded_logits(model, batch, temperature)
    mask = batch["response_mask"].bool()
    expected = torch.where(mask, torch.softmax(logits.float(), dim=-1).square().sum(-1), 0.0)
    with torch.no_grad():
        scores = score_responses(
            model,
            **batch,
            temperature=temperature,
            chunk_tokens=chunk_tokens,
            with_sum_pi_squared=True,
        )
        plain = score_responses(model, **batch, temperature=temperature, chunk_tokens=chunk_tokens)
    torch.testing.assert_close(scores.sum_pi_squared, expected, atol=1e-6, rtol=0)
    assert scores.entropy is None and plain.sum_pi_squared is None
    assert torch.equal(scores.log_probs, plain.log_probs)
