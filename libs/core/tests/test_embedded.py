import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlserve.core.embedded.evaluate import greedy_accuracy
from rlserve.core.embedded.model import build_tiny_llama, save_model
from rlserve.core.embedded.task import addition_rows, exact_match, read_jsonl, write_jsonl
from rlserve.core.embedded.tokenizer import save_char_tokenizer
from rlserve.core.embedded.warmup import (
    IGNORE_INDEX,
    StopAtAccuracy,
    collate_sft,
    encode_sft_rows,
    supervised_warmup,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    tokenizer = save_char_tokenizer(directory)
    model = build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    save_model(model, directory)
    return directory, model


def test_tokenizer_reloads_offline_and_round_trips(saved):
    directory, _ = saved
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer("23+45=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 7
    assert tokenizer.decode(ids, skip_special_tokens=True) == "23+45="
    padded = tokenizer(["1+1=", "10+10="], padding=True)["input_ids"]
    assert padded[0][:2] == [tokenizer.pad_token_id] * 2  # left padding for generation
    assert tokenizer("é")["input_ids"][1] == tokenizer.unk_token_id


def test_model_reloads_from_safetensors_with_equal_logits(saved):
    directory, model = saved
    assert (directory / "model.safetensors").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(directory)
    ids = torch.tensor([[1, 20, 21, 22]])
    assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_addition_rows_are_correct_and_disjoint(tmp_path):
    train, held_out = addition_rows(operand_max=20, train_pairs=300, eval_pairs=100, seed=3)
    assert len(train) == 300 and len(held_out) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        a, b = row["prompt"].rstrip("=").split("+")
        assert int(row["ground_truth"]) == int(a) + int(b)
    write_jsonl(held_out, tmp_path / "eval.jsonl")
    assert read_jsonl(tmp_path / "eval.jsonl") == held_out
    with pytest.raises(ValueError, match="exceeds the 441 distinct pairs"):
        addition_rows(operand_max=20, train_pairs=400, eval_pairs=100, seed=0)


def test_sft_batch_masks_the_prompt(saved):
    tokenizer = AutoTokenizer.from_pretrained(saved[0])
    examples = encode_sft_rows([{"prompt": "1+2=", "ground_truth": "3"}], tokenizer)
    batch = collate_sft(examples, tokenizer.pad_token_id)
    labels = batch["labels"][0].tolist()
    assert labels[:5] == [IGNORE_INDEX] * 5  # <bos> 1 + 2 =
    assert labels[5:] == [tokenizer.convert_tokens_to_ids("3"), tokenizer.eos_token_id]


def test_warmup_learns_a_fixed_answer(saved):
    directory, _ = saved
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    rows = [{"prompt": f"{a}+0=", "ground_truth": "7"} for a in range(10)]
    assert greedy_accuracy(model, tokenizer, rows, max_new_tokens=2) == 0.0
    warmup = supervised_warmup(model, tokenizer, rows, steps=60, batch_size=8, lr=1e-2, seed=0)
    assert warmup.steps == 60 and warmup.checks == [] and not warmup.reached_target
    assert warmup.losses[-1] < warmup.losses[0] / 4
    assert greedy_accuracy(model, tokenizer, rows, max_new_tokens=2, batch_prompts=3) == 1.0


def test_warmup_stops_at_the_first_check_that_reaches_its_target(saved):
    directory, _ = saved
    tokenizer = AutoTokenizer.from_pretrained(directory)
    rows = [{"prompt": f"{a}+0=", "ground_truth": "7"} for a in range(10)]
    stop = StopAtAccuracy(rows[:4], target=1.0, every_steps=5, max_new_tokens=2)
    model = AutoModelForCausalLM.from_pretrained(directory)
    warmup = supervised_warmup(model, tokenizer, rows[4:], 60, 4, 1e-2, seed=0, stop=stop)
    assert warmup.reached_target and warmup.steps < 60
    steps = [step for step, _ in warmup.checks]
    assert steps == list(range(5, warmup.steps + 1, 5))
    assert all(accuracy < 1.0 for _, accuracy in warmup.checks[:-1])
    assert greedy_accuracy(model, tokenizer, rows[:4], max_new_tokens=2) == 1.0
    # Out of reach: runs every step, checks at the end too, and says it missed.
    model = AutoModelForCausalLM.from_pretrained(directory)
    never = StopAtAccuracy(rows[:4], target=1.0, every_steps=4, max_new_tokens=2)
    warmup = supervised_warmup(model, tokenizer, rows[4:], 6, 4, 1e-6, seed=0, stop=never)
    assert warmup.steps == 6 and [s for s, _ in warmup.checks] == [4, 6]
    assert not warmup.reached_target


def test_exact_match_ignores_surrounding_space_only():
    assert exact_match(" 68 ", "68")
    assert not exact_match("6 8", "68")
    assert not exact_match("", "68")
