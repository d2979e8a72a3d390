"""The checks and reports a run makes before and right after its services are up, no Ray.

prepare_inputs refuses a prompt + response budget that does not fit the model's context;
make_trainer prints how many prompts each dataset kept, dropped and cut.
"""

import asyncio
import io
import json

import pytest
from rich.console import Console
from transformers import LlamaConfig, LlavaConfig

from rlserve.core.config import ConfigError, load_config
from rlserve.core.embedded.tokenizer import save_char_tokenizer
from rlserve.core.run_config import RunConfig
from rlserve.trainer import run
from rlserve.trainer.run import RunInputs, make_trainer, prepare_inputs

CONTEXT_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A HF model directory with a 32-position Llama config and the char tokenizer.

    No weights: nothing here loads the model.
    """
    directory = tmp_path_factory.mktemp("llama32")
    tokenizer = save_char_tokenizer(directory)
    LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=CONTEXT_TOKENS,
    ).save_pretrained(directory)
    return directory


@pytest.fixture()
def train_path(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    return path


def config_for(model_dir, train_path, *overrides):
    return load_config(
        RunConfig,
        overrides=[f"model.path={model_dir}", f"data.train_path={train_path}", *overrides],
    )


def test_prompt_plus_response_over_the_context_names_both_fields(tmp_path, model_dir, train_path):
    config = config_for(
        model_dir, train_path, "data.max_prompt_tokens=30", "rollout.max_new_tokens=4"
    )
    with pytest.raises(ConfigError) as info:
        prepare_inputs(config, tmp_path)
    assert info.value.paths == ("data.max_prompt_tokens",)
    message = str(info.value)
    assert message.startswith(
        "data.max_prompt_tokens: 30 + rollout.max_new_tokens 4 = 34 tokens exceed the "
        f"model's context of 32 (max_position_embeddings in {model_dir / 'config.json'}); "
    )
    assert "lower data.max_prompt_tokens to 28, or lower both" in message


def test_responses_alone_over_the_context_point_at_max_new_tokens(tmp_path, model_dir, train_path):
    config = config_for(
        model_dir, train_path, "data.max_prompt_tokens=8", "rollout.max_new_tokens=32"
    )
    with pytest.raises(ConfigError, match=r"lower rollout.max_new_tokens below 32"):
        prepare_inputs(config, tmp_path)


def test_prompt_plus_response_exactly_the_context_passes(tmp_path, model_dir, train_path):
    config = config_for(
        model_dir, train_path, "data.max_prompt_tokens=28", "rollout.max_new_tokens=4"
    )
    inputs = prepare_inputs(config, tmp_path)
    assert inputs.model_dir == str(model_dir.resolve())
    assert inputs.train_path == str(train_path)


def test_multimodal_config_is_checked_against_its_text_model(tmp_path, train_path):
    directory = tmp_path / "llava"
    LlavaConfig(text_config=LlamaConfig(max_position_embeddings=CONTEXT_TOKENS)).save_pretrained(
        directory
    )
    config = config_for(
        directory, train_path, "data.max_prompt_tokens=30", "rollout.max_new_tokens=4"
    )
    with pytest.raises(ConfigError, match=r"exceed the model's context of 32 "):
        prepare_inputs(config, tmp_path)


def test_embedded_default_is_checked_once_built(tmp_path):
    """The embedded tiny Llama has 128 positions; a quick build (no warm-up) finds that."""
    config = load_config(
        RunConfig,
        overrides=[
            "model.tiny.hidden_size=16",
            "model.tiny.num_layers=1",
            "model.tiny.num_heads=2",
            "model.tiny.intermediate_size=32",
            "model.tiny.sft_max_steps=0",
            "data.arithmetic.train_pairs=4",
            "data.arithmetic.eval_pairs=2",
            "rollout.eval_prompts=2",
            "data.max_prompt_tokens=125",
            "rollout.max_new_tokens=4",
        ],
    )
    with pytest.raises(ConfigError, match=r"^data.max_prompt_tokens: 125 \+ rollout.max_new"):
        prepare_inputs(config, tmp_path)


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "ground_truth": "0"}) + "\n" for p in prompts))
    return path


def trainer_output(monkeypatch, config, inputs, run_dir):
    """What make_trainer prints, and the trainer it builds."""
    output = io.StringIO()
    monkeypatch.setattr(run, "console", Console(file=output, width=400, color_system=None))
    # gRPC channels connect lazily: no service is needed to build the trainer. Built in
    # an event loop of its own, as in a run (aio channels need one; earlier tests in the
    # session may have closed the default loop).

    async def build():
        return make_trainer(config, inputs, run_dir, "127.0.0.1:1")

    trainer = asyncio.run(build())
    return output.getvalue().splitlines(), trainer


def test_make_trainer_reports_dropped_prompts_and_the_fix(tmp_path, model_dir, monkeypatch):
    # <bos> + n characters each: 5, 21, 5 and 31 tokens.
    train = write_prompts(tmp_path / "train.jsonl", ["1+1=", "x" * 20, "2+2=", "y" * 30])
    config = config_for(model_dir, train, "data.max_prompt_tokens=10")
    lines, trainer = trainer_output(
        monkeypatch, config, RunInputs(str(model_dir), str(train), None), tmp_path
    )
    assert lines == [
        "train: 2 prompts, 2 dropped, 0 truncated, longest 31 tokens (data.max_prompt_tokens=10, "
        "data.long_prompts=drop); to keep them, raise data.max_prompt_tokens or set "
        "data.long_prompts=truncate_left",
    ]
    assert sorted(row.prompt for row in trainer.stream.rows) == ["1+1=", "2+2="]
    assert trainer.eval_rows == []


def test_make_trainer_reports_truncated_train_and_eval(tmp_path, model_dir, monkeypatch):
    train = write_prompts(tmp_path / "train.jsonl", ["1+1=", "abcdefghijklmnopqrst"])
    evals = write_prompts(tmp_path / "eval.jsonl", ["2+2=", "3+3=", "ABCDEFGHIJKL"])
    config = config_for(
        model_dir,
        train,
        f"data.eval_path={evals}",
        "data.max_prompt_tokens=10",
        "data.long_prompts=truncate_left",
    )
    lines, trainer = trainer_output(
        monkeypatch, config, RunInputs(str(model_dir), str(train), str(evals)), tmp_path
    )
    settings = "(data.max_prompt_tokens=10, data.long_prompts=truncate_left)"
    assert lines == [
        f"train: 2 prompts, 0 dropped, 1 truncated, longest 21 tokens {settings}",
        f"eval: 3 prompts, 0 dropped, 1 truncated, longest 13 tokens {settings}",
    ]
    assert sorted(row.prompt for row in trainer.stream.rows) == ["1+1=", "lmnopqrst"]
    assert [row.prompt for row in trainer.eval_rows] == ["2+2=", "3+3=", "DEFGHIJKL"]
