import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlserve.core.modeling import load_tokenizer
from rlserve.trainer.data import PromptRow, PromptStream, load_prompt_rows, prompt_batch


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_flat_jsonl(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text(
        '{"prompt": "1+2=", "ground_truth": "3"}\n\n{"prompt": "10+5=", "ground_truth": 15}\n'
    )
    rows = load_prompt_rows(path, tokenizer)
    assert rows == [PromptRow("1+2=", "3"), PromptRow("10+5=", "15")]


def test_verl_layout_parquet_with_dotted_key(tmp_path, tokenizer):
    table = pa.Table.from_pylist(
        [
            {
                "prompt": [{"role": "user", "content": "What is 2+2?"}],
                "reward_model": {"ground_truth": "4", "style": "rule"},
            }
        ]
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    rows = load_prompt_rows(path, tokenizer, ground_truth_key="reward_model.ground_truth")
    # No chat template on the char tokenizer: the message content is the prompt.
    assert rows == [PromptRow("What is 2+2?", "4")]


def test_missing_key_names_it_and_the_setting(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 has no 'prompt'.*data.prompt_key"):
        load_prompt_rows(path, tokenizer)


def test_long_prompts_dropped_and_empty_result_is_an_error(tmp_path, tokenizer):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 50, "ground_truth": "1"}) + "\n")
    with pytest.raises(ValueError, match="no usable rows"):
        load_prompt_rows(path, tokenizer, max_prompt_tokens=10)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_rows(tmp_path / "nope.jsonl", tokenizer)


def test_prompt_batch_left_pads(tokenizer):
    batch = prompt_batch([PromptRow("1+1=", "2"), PromptRow("10+10=", "20")], tokenizer)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape == (2, 7)
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert ids[0, 0] == tokenizer.pad_token_id and ids[0, 2] == tokenizer.bos_token_id
    assert batch["ground_truth"] == ["2", "20"]


def test_stream_resumes_at_the_same_rows():
    rows = [PromptRow(str(i), str(i)) for i in range(10)]
    stream = PromptStream(rows, seed=7)
    first = stream.next_rows(7)
    saved = stream.state_dict()
    expected = stream.next_rows(9)  # crosses into the next epoch
    resumed = PromptStream(rows, seed=7)
    resumed.load_state_dict(saved)
    assert resumed.next_rows(9) == expected
    epoch0 = first + expected[:3]
    assert sorted(r.prompt for r in epoch0) == sorted(r.prompt for r in rows)
