"""The 'hf' generation engine on the tiny Llama, in-process (no Ray, no DeepSpeed)."""

import json
import shutil
import time
from dataclasses import replace

import grpc
import pytest
import torch
from transformers import GenerationConfig

from rlserve.core.modeling import load_causal_lm, log_probs_from_logits, response_logits
from rlserve.core.serving import RpcError
from rlserve.rollout.generation import SamplingSettings
from rlserve.rollout.hf_engine import HFGenerationEngine

PROMPTS = [[1, 21, 15, 22, 33], [1, 23, 23, 15, 24, 24, 33], [1, 40]]
GREEDY = SamplingSettings(
    temperature=0.0,
    top_p=1.0,
    top_k=-1,
    max_new_tokens=6,
    responses_per_prompt=1,
    seed=None,
    ignore_eos=False,
    return_log_probs=True,
)
SAMPLED = replace(GREEDY, temperature=1.0, responses_per_prompt=3, seed=7)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFGenerationEngine(str(tiny_model_dir))


def test_responses_per_prompt_are_adjacent_and_bounded(engine):
    out = engine.generate(PROMPTS, SAMPLED)
    assert len(out.response_ids) == len(PROMPTS) * 3
    assert all(1 <= len(ids) <= SAMPLED.max_new_tokens for ids in out.response_ids)
    assert [len(lp) for lp in out.log_probs] == [len(ids) for ids in out.response_ids]
    assert all(value <= 0 for row in out.log_probs for value in row)
    # n > 1 works greedily too, and then the n responses of a prompt are identical
    greedy = engine.generate(PROMPTS, replace(GREEDY, responses_per_prompt=2))
    assert greedy.response_ids[0::2] == greedy.response_ids[1::2]
    assert greedy.response_ids[0::2] == engine.generate(PROMPTS, GREEDY).response_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine):
    first = engine.generate(PROMPTS, SAMPLED)
    torch.manual_seed(123)  # the global RNG state must not matter for a seeded call
    assert engine.generate(PROMPTS, SAMPLED).response_ids == first.response_ids
    other = engine.generate(PROMPTS, replace(SAMPLED, seed=8))
    assert other.response_ids != first.response_ids


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(PROMPTS, GREEDY)
    top1 = engine.generate(PROMPTS, replace(GREEDY, temperature=1.3, top_k=1, seed=3))
    assert top1.response_ids == greedy.response_ids


def test_log_probs_equal_a_full_forward_pass(engine, tiny_model_dir):
    """Per-token log-probs of the sampled tokens under softmax(logits / T), T = 0.7 here."""
    sampling = replace(SAMPLED, temperature=0.7)
    out = engine.generate(PROMPTS, sampling)
    model = load_causal_lm(tiny_model_dir)
    prompts = [p for p in PROMPTS for _ in range(3)]
    for prompt, response, log_probs in zip(prompts, out.response_ids, out.log_probs, strict=True):
        ids = torch.tensor([prompt + response])
        logits = response_logits(model, ids, torch.ones_like(ids), len(response), 0.7)
        expected = log_probs_from_logits(logits, torch.tensor([response]))[0]
        torch.testing.assert_close(torch.tensor(log_probs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, replace(SAMPLED, temperature=0.7, top_k=5, top_p=0.9, ignore_eos=True)],
    ids=["greedy", "truncated"],
)
def test_step_by_step_log_probs_equal_the_stacked_logits(engine, sampling):
    """Issue 30 defect 7: the engine kept every step's fp32 logits, [rows, steps, vocab],
    to read the sampled tokens' log-probs. Taken step by step now, they are the same
    numbers as the stacked logits transformers returns (output_logits), for the same
    tokens, and asking for them does not change what is sampled."""
    for prompt in PROMPTS:
        out = engine.generate([prompt], sampling)
        greedy = sampling.temperature == 0
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_k=None if greedy else sampling.top_k,
            top_p=None if greedy else sampling.top_p,
            eos_token_id=None if sampling.ignore_eos else sorted(engine.eos_token_ids),
            pad_token_id=engine.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        ids = torch.tensor([prompt] * sampling.responses_per_prompt)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sampling.seed or 0)
            reference = engine.model.generate(input_ids=ids, generation_config=config)
        tokens = reference.sequences[:, len(prompt) :]
        temperature = 1.0 if greedy else sampling.temperature
        stacked = torch.stack(reference.logits, dim=1).float() / temperature
        expected = torch.log_softmax(stacked, dim=-1).gather(-1, tokens.unsqueeze(-1))[..., 0]
        for row, (response, log_probs) in enumerate(
            zip(out.response_ids, out.log_probs, strict=True)
        ):
            assert response == tokens[row, : len(response)].tolist()
            torch.testing.assert_close(
                torch.tensor(log_probs), expected[row, : len(response)], atol=1e-6, rtol=0
            )
        unscored = engine.generate([prompt], replace(sampling, return_log_probs=False))
        assert unscored.response_ids == out.response_ids


def test_stops_at_eos_and_ignore_eos_keeps_going(engine, tiny_model_dir, tmp_path):
    """A model whose EOS is a token greedy decoding emits: rows end right after it."""
    greedy = engine.generate(PROMPTS, GREEDY).response_ids
    eos = greedy[0][2]  # prompt 0's third new token becomes the EOS
    model_dir = tmp_path / "eos_model"
    shutil.copytree(tiny_model_dir, model_dir)
    config_path = model_dir / "generation_config.json"
    generation_config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**generation_config, "eos_token_id": eos}))
    stopping = HFGenerationEngine(str(model_dir))

    out = stopping.generate(PROMPTS, GREEDY).response_ids
    for full, cut in zip(greedy, out, strict=True):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert cut == expected
    assert out[0] == greedy[0][:3]
    assert stopping.generate(PROMPTS, replace(GREEDY, ignore_eos=True)).response_ids == greedy


def test_load_weights_changes_generation_and_rejects_foreign_names(engine, tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    before = engine.generate(PROMPTS, GREEDY)
    torch.manual_seed(0)
    perturbed = {k: v + 0.5 * torch.randn_like(v) for k, v in model.state_dict().items()}
    local = HFGenerationEngine(str(tiny_model_dir))
    local.load_weights(perturbed)
    after = local.generate(PROMPTS, GREEDY)
    assert after.log_probs != before.log_probs
    local.load_weights(model.state_dict())  # and back
    assert local.generate(PROMPTS, GREEDY) == before
    with pytest.raises(ValueError, match="not in the generation model"):
        local.load_weights({**model.state_dict(), "extra.weight": torch.zeros(1)})
    partial = dict(model.state_dict())
    partial.pop("lm_head.weight")
    with pytest.raises(ValueError, match="weights missing"):
        local.load_weights(partial)


def test_top_k_off_samples_outside_the_top_fifty(engine):
    """top_k -1 really is off (transformers' own default would keep only 50 tokens)."""
    sampling = replace(SAMPLED, temperature=5.0, responses_per_prompt=64, max_new_tokens=4)
    sampled = engine.generate(PROMPTS[:1], sampling).response_ids
    model_logits = engine.model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1]
    top50 = set(model_logits.topk(50).indices.tolist())
    assert any(ids[0] not in top50 for ids in sampled)


def test_a_passed_deadline_stops_generation_within_a_token_and_the_engine_serves_on(engine):
    """Issue 12 defect 7: a generation its caller had given up on ran to the end (74 s
    for 4096 × 120 tokens) while later calls waited. Now it stops at the next token."""
    greedy = engine.generate(PROMPTS, GREEDY).response_ids
    assert engine.generate(PROMPTS, GREEDY, deadline=time.time() + 60).response_ids == greedy
    long = replace(GREEDY, max_new_tokens=100, ignore_eos=True, return_log_probs=False)
    rows = [PROMPTS[0]] * 1024
    started = time.perf_counter()
    assert len(engine.generate(rows, long).response_ids[0]) == 100
    full_s = time.perf_counter() - started
    started = time.perf_counter()
    with pytest.raises(RpcError) as error:
        engine.generate(rows, long, deadline=time.time() + full_s / 10)
    stopped_s = time.perf_counter() - started
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.value.message == "caller's deadline passed during GenerateSequences"
    assert stopped_s < full_s / 2, (stopped_s, full_s)
    with pytest.raises(RpcError):  # already passed: no work at all
        engine.generate(rows, long, deadline=time.time() - 1)
    assert engine.generate(PROMPTS, GREEDY).response_ids == greedy


def test_a_stop_string_ends_a_response_at_the_token_that_completes_it(engine):
    unstopped = replace(GREEDY, max_new_tokens=16, ignore_eos=True, return_log_probs=False)
    full = engine.generate(PROMPTS, unstopped).response_ids
    decode = engine.tokenizer.decode
    texts = [decode(ids, skip_special_tokens=True) for ids in full]
    # a plain-text string some greedy response reaches part-way (stop strings are text)
    stop = next(text[3:5] for text in texts if len(text) >= 6)
    stopped = engine.generate(PROMPTS, replace(unstopped, stop_strings=(stop, "\x00never")))
    for ids, out in zip(full, stopped.response_ids, strict=True):
        reached = [
            k for k in range(1, len(ids) + 1) if stop in decode(ids[:k], skip_special_tokens=True)
        ]
        # greedy: the same tokens, cut right after the one that completed the stop string
        assert out == (ids[: reached[0]] if reached else ids)
    assert sum(map(len, stopped.response_ids)) < sum(map(len, full))
