import json
from typing import get_args

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rlserve.core.inputs_config import DataConfig
from rlserve.core.modeling import load_tokenizer
from rlserve.trainer.data import (
    LongPrompts,
    PromptRow,
    PromptRows,
    PromptStream,
    load_prompt_rows,
    prompt_batch,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_flat_jsonl(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text(
        '{"prompt": "1+2=", "ground_truth": "3"}\n\n{"prompt": "10+5=", "ground_truth": 15}\n'
    )
    loaded = load_prompt_rows(path, tokenizer)
    # <bos> + 5 characters; no limit given, so nothing is dropped or cut.
    assert loaded == PromptRows(
        [PromptRow("1+2=", "3"), PromptRow("10+5=", "15")],
        dropped=0,
        truncated=0,
        longest_tokens=6,
    )


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
    loaded = load_prompt_rows(path, tokenizer, ground_truth_key="reward_model.ground_truth")
    # No chat template on the char tokenizer: the message content is the prompt.
    assert loaded.rows == [PromptRow("What is 2+2?", "4")]


def test_tools_kwargs_of_each_row_reach_the_prompt_batch(tmp_path, tokenizer):
    """VeRL's layout keeps them under extra_info; given as an object or its JSON text;
    a row without them passes none, and a batch of such rows has no column for them."""
    rows = [
        {"prompt": "1+2=", "ground_truth": "3", "extra_info": {"tools_kwargs": {"calc": {"x": 1}}}},
        {"prompt": "2+2=", "ground_truth": "4", "extra_info": {"tools_kwargs": '{"calc": {}}'}},
        {"prompt": "3+2=", "ground_truth": "5"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = load_prompt_rows(path, tokenizer, tools_kwargs_key="extra_info.tools_kwargs")
    assert [row.tools_kwargs for row in loaded.rows] == ['{"calc": {"x": 1}}', '{"calc": {}}', ""]
    batch = prompt_batch(loaded.rows, tokenizer)
    assert batch.non_tensors["tools_kwargs"] == ['{"calc": {"x": 1}}', '{"calc": {}}', ""]
    assert "tools_kwargs" not in prompt_batch(loaded.rows[2:], tokenizer).non_tensors


@pytest.mark.parametrize("value", [[1, 2], "not json", 7])
def test_tools_kwargs_that_are_no_object_name_the_row_and_the_setting(tmp_path, tokenizer, value):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "ground_truth": "3", "tools_kwargs": value}))
    with pytest.raises(
        ValueError, match=r"row 0: 'tools_kwargs' must be an object.*tools_kwargs_key"
    ):
        load_prompt_rows(path, tokenizer)


def test_missing_key_names_it_and_the_setting(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 has no 'prompt'.*data.prompt_key"):
        load_prompt_rows(path, tokenizer)


def test_long_prompts_dropped_and_empty_result_is_an_error(tmp_path, tokenizer):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 50, "ground_truth": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"no usable rows \(1 read, 1 of them longer than "):
        load_prompt_rows(path, tokenizer, max_prompt_tokens=10)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_rows(tmp_path / "nope.jsonl", tokenizer)


# --- prompts over max_prompt_tokens -----------------------------------------------------

# The char tokenizer encodes a prompt as <bos> + one token per character, so a prompt of
# n characters is n + 1 tokens: at max_prompt_tokens=10, 9 characters fit and 10 do not.
LENGTHS = [9, 10, 3, 25, 10]


def write_rows(tmp_path, prompts):
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps({"prompt": p, "ground_truth": str(i)}) for i, p in enumerate(prompts)]
    path.write_text("\n".join(lines) + "\n")
    return path


def alphabet_prompts():
    """Prompts of LENGTHS characters, each a run of the alphabet so a cut shows its side."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [letters[:n] for n in LENGTHS]


def test_drop_counts_the_dropped_rows_and_keeps_the_rest_in_order(tmp_path, tokenizer):
    path = write_rows(tmp_path, alphabet_prompts())
    loaded = load_prompt_rows(path, tokenizer, max_prompt_tokens=10, long_prompts="drop")
    assert [row.ground_truth for row in loaded.rows] == ["0", "2"]
    assert (loaded.dropped, loaded.truncated, loaded.longest_tokens) == (3, 0, 26)


def test_drop_is_the_default(tmp_path, tokenizer):
    path = write_rows(tmp_path, alphabet_prompts())
    assert load_prompt_rows(path, tokenizer, max_prompt_tokens=10).dropped == 3
    assert DataConfig().long_prompts == "drop"


def test_truncate_left_keeps_the_end(tmp_path, tokenizer):
    path = write_rows(tmp_path, alphabet_prompts())
    loaded = load_prompt_rows(path, tokenizer, max_prompt_tokens=10, long_prompts="truncate_left")
    assert [row.prompt for row in loaded.rows] == [
        "abcdefghi",  # fits: untouched
        "bcdefghij",
        "abc",
        "qrstuvwxy",
        "bcdefghij",
    ]
    assert [row.ground_truth for row in loaded.rows] == ["0", "1", "2", "3", "4"]
    assert (loaded.dropped, loaded.truncated, loaded.longest_tokens) == (0, 3, 26)
    # <bos> + 9 characters: exactly the limit, BOS counted.
    assert [len(tokenizer(row.prompt)["input_ids"]) for row in loaded.rows] == [10, 10, 4, 10, 10]


def test_truncate_right_keeps_the_start(tmp_path, tokenizer):
    path = write_rows(tmp_path, alphabet_prompts())
    loaded = load_prompt_rows(path, tokenizer, max_prompt_tokens=10, long_prompts="truncate_right")
    assert [row.prompt for row in loaded.rows] == [
        "abcdefghi",
        "abcdefghi",
        "abc",
        "abcdefghi",
        "abcdefghi",
    ]
    assert (loaded.dropped, loaded.truncated, loaded.longest_tokens) == (0, 3, 26)


def test_error_names_the_first_long_row_and_the_fix(tmp_path, tokenizer):
    path = write_rows(tmp_path, alphabet_prompts())
    with pytest.raises(ValueError) as info:
        load_prompt_rows(path, tokenizer, max_prompt_tokens=10, long_prompts="error")
    message = str(info.value)
    assert f"{path}: row 1 has a prompt of 11 tokens" in message
    assert "data.max_prompt_tokens=10 (3 of 5 rows are; the longest has 26)" in message
    assert "raise data.max_prompt_tokens to 26" in message
    assert "data.long_prompts to drop, truncate_left or truncate_right" in message


def test_error_passes_when_every_prompt_fits(tmp_path, tokenizer):
    path = write_rows(tmp_path, alphabet_prompts())
    loaded = load_prompt_rows(path, tokenizer, max_prompt_tokens=26, long_prompts="error")
    assert (len(loaded.rows), loaded.dropped, loaded.truncated) == (5, 0, 0)


def test_unknown_policy_names_the_setting(tmp_path, tokenizer):
    path = write_rows(tmp_path, ["a"])
    with pytest.raises(ValueError, match=r"data.long_prompts: must be one of .*'truncat'"):
        load_prompt_rows(path, tokenizer, max_prompt_tokens=10, long_prompts="truncat")  # type: ignore[arg-type]


def test_no_room_next_to_bos_names_the_setting(tmp_path, tokenizer):
    path = write_rows(tmp_path, ["abc"])
    with pytest.raises(ValueError, match=r"row 0: data.max_prompt_tokens=1 leaves no room"):
        load_prompt_rows(path, tokenizer, max_prompt_tokens=1, long_prompts="truncate_left")


def test_run_config_offers_the_policies_the_loader_knows():
    annotation = DataConfig.model_fields["long_prompts"].annotation
    assert get_args(annotation) == get_args(LongPrompts)


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Byte-level BPE without merges (one token per UTF-8 byte) that prepends <bos>.

    'é' is two tokens, so a cut can split it; the half decodes to U+FFFD, which encodes
    to three bytes: the re-encoded cut is longer than the cut.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<bos>": 0, **{char: i + 1 for i, char in enumerate(alphabet)}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>")


@pytest.mark.parametrize(
    ("max_tokens", "left", "right"),
    # "aéébé" is 8 bytes: a é é b é. Cuts that would split an é keep one byte less.
    [(3, "é", "a"), (4, "bé", "aé"), (5, "bé", "aé"), (6, "ébé", "aéé"), (7, "ébé", "aééb")],
)
def test_cuts_keep_whole_characters_and_fit_after_re_encoding(
    tmp_path, byte_tokenizer, max_tokens, left, right
):
    path = write_rows(tmp_path, ["aéébé"])
    for policy, expected in (("truncate_left", left), ("truncate_right", right)):
        loaded = load_prompt_rows(
            path, byte_tokenizer, max_prompt_tokens=max_tokens, long_prompts=policy
        )
        assert [row.prompt for row in loaded.rows] == [expected], policy
        assert len(byte_tokenizer(expected)["input_ids"]) <= max_tokens
        assert (loaded.truncated, loaded.longest_tokens) == (1, 9)


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
