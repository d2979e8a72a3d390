"""Builds the embedded default on disk: tokenizer + warmed-up tiny Llama + task data.

The result is a plain HF model directory and two jsonl files, exactly what a user would
point rlserve at for their own model and dataset, so everything downstream (services,
trainer) runs the same code either way.
"""

import time
from dataclasses import dataclass
from pathlib import Path

from rlserve.core.config import ConfigError
from rlserve.core.embedded import tool_task
from rlserve.core.embedded.evaluate import greedy_accuracy
from rlserve.core.embedded.model import build_tiny_llama, save_model
from rlserve.core.embedded.task import addition_rows, write_jsonl
from rlserve.core.embedded.tokenizer import save_char_tokenizer
from rlserve.core.embedded.warmup import StopAtAccuracy, encode_sft_rows, supervised_warmup
from rlserve.core.inputs_config import ArithmeticTaskConfig, TinyModelConfig


@dataclass(frozen=True)
class EmbeddedDefault:
    """Where the embedded default was written, and how good the warmed-up policy is."""

    model_dir: Path
    train_path: Path
    eval_path: Path
    warmup_accuracy: float
    """Held-out greedy exact-match accuracy of the warmed-up model (0..1)."""
    warmup_final_loss: float
    warmup_s: float
    warmup_steps: int
    warmup_reached_target: bool
    """False when the warm-up ran all sft_max_steps without reaching its target (or had
    none)."""


def prepare_embedded_default(
    out_dir: Path,
    tiny: TinyModelConfig,
    task: ArithmeticTaskConfig,
    seed: int,
    max_new_tokens: int,
    eval_prompts: int,
    with_tools: bool = False,
) -> EmbeddedDefault:
    """Writes out_dir/model (HF format) and out_dir/data/{train,eval}.jsonl. With
    `with_tools` (a run with rollout.agent) the "product_plus" task's warm-up teaches
    whole tool-calling episodes and the tokenizer carries their chat template."""
    model_dir, data_dir = out_dir / "model", out_dir / "data"
    episodes = with_tools and task.kind == "product_plus"
    tokenizer = save_char_tokenizer(model_dir)
    if episodes:
        tokenizer.chat_template = tool_task.CHAT_TEMPLATE
        tokenizer.save_pretrained(model_dir)
    model = build_tiny_llama(
        tokenizer,
        hidden_size=tiny.hidden_size,
        num_layers=tiny.num_layers,
        num_heads=tiny.num_heads,
        intermediate_size=tiny.intermediate_size,
        seed=seed,
    )
    make_rows = addition_rows if task.kind == "addition" else tool_task.product_plus_rows
    train_rows, eval_rows = make_rows(
        task.operand_max, task.train_pairs, task.eval_pairs, seed=seed
    )
    accuracy = tool_task.episode_accuracy if episodes else greedy_accuracy
    write_jsonl(train_rows, data_dir / "train.jsonl")
    write_jsonl(eval_rows, data_dir / "eval.jsonl")

    started = time.perf_counter()
    stop = None
    if tiny.sft_target_accuracy is not None and tiny.sft_max_steps:
        if tiny.sft_check_prompts >= len(train_rows):
            raise ConfigError(
                "model.tiny.sft_check_prompts",
                f"{tiny.sft_check_prompts} leaves no training pairs for the warm-up out of "
                f"{len(train_rows)}; lower it or raise data.arithmetic.train_pairs",
            )
        check_rows = train_rows[-tiny.sft_check_prompts :]
        warmup_rows = train_rows[: -tiny.sft_check_prompts]
        stop = StopAtAccuracy(
            check_rows, tiny.sft_target_accuracy, tiny.sft_check_every_steps, max_new_tokens
        )
    else:
        warmup_rows = train_rows
    warmup = supervised_warmup(
        model,
        tokenizer,
        warmup_rows,
        steps=tiny.sft_max_steps,
        batch_size=tiny.sft_batch_samples,
        lr=tiny.sft_lr,
        seed=seed,
        stop=stop,
        encode=tool_task.encode_episodes if episodes else encode_sft_rows,
        accuracy=accuracy,
    )
    warmup_s = time.perf_counter() - started
    save_model(model, model_dir)
    held_out = accuracy(model, tokenizer, eval_rows[:eval_prompts], max_new_tokens)
    return EmbeddedDefault(
        model_dir=model_dir,
        train_path=data_dir / "train.jsonl",
        eval_path=data_dir / "eval.jsonl",
        warmup_accuracy=held_out,
        warmup_final_loss=warmup.losses[-1] if warmup.losses else float("nan"),
        warmup_s=warmup_s,
        warmup_steps=warmup.steps,
        warmup_reached_target=warmup.reached_target,
    )
