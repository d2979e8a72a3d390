"""Where a run's policy and prompts come from: the run config's `model` and `data`
sections.

Either a Hugging Face model directory and jsonl/parquet prompt files, or the embedded
default built locally (`TinyModelConfig`, `ArithmeticTaskConfig`; rlserve.core.embedded
builds them). rlserve.trainer.run.prepare_inputs resolves these sections into the run's
RunInputs before any cluster starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlserve.core.config import ConfigError, ConfigModel

__all__ = [
    "LARGE_MODEL_WEIGHT_BYTES",
    "ArithmeticTaskConfig",
    "DataConfig",
    "Dtype",
    "ModelConfig",
    "TinyModelConfig",
    "data_format",
    "model_weight_bytes",
]

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
"""Parameter dtypes a policy (and the services' copies of it) may be loaded in; each
worker resolves "auto" for its own device (rlserve.core.modeling.resolve_dtype):
bfloat16 on a GPU with native bf16, else float32."""

_DATA_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}


def data_format(path: str) -> Literal["jsonl", "parquet"]:
    """The dataset format implied by a file's suffix; ValueError for any other suffix."""
    suffix = Path(path).suffix.lower()
    if suffix not in _DATA_FORMATS:
        raise ValueError(
            f"cannot tell the format of {path!r} from its suffix {suffix or '(none)'!r}; "
            "use a .jsonl or .parquet file"
        )
    return _DATA_FORMATS[suffix]  # type: ignore[return-value]


# --- model ------------------------------------------------------------------------------


class TinyModelConfig(ConfigModel):
    """Shape and supervised warm-up of the embedded tiny model (used when model.path is None)."""

    hidden_size: int = Field(128, ge=1)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1)
    """Number of transformer blocks."""
    num_heads: int = Field(4, ge=1)
    """Attention heads per block; must divide hidden_size."""
    intermediate_size: int = Field(256, ge=1)
    """Width of each block's MLP."""
    sft_max_steps: int = Field(1500, ge=0)
    """Most supervised warm-up steps on the training pairs before RL (0 = start from
    random); the warm-up stops earlier once it reaches sft_target_accuracy."""
    sft_batch_samples: int = Field(128, ge=1)
    """Samples per supervised warm-up step."""
    sft_lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of the supervised warm-up."""
    sft_target_accuracy: float | None = Field(0.30, gt=0, le=1)
    """Stop the warm-up once greedy accuracy on sft_check_prompts training pairs it does
    not train on reaches this (0..1), so RL starts from the same place whatever the seed
    or CPU; None trains all sft_max_steps."""
    sft_check_every_steps: int = Field(10, ge=1)
    """Warm-up steps between accuracy checks."""
    sft_check_prompts: int = Field(256, ge=1)
    """Training pairs held out of the warm-up to check its accuracy on (RL still uses them)."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                "num_heads",
                f"must divide hidden_size ({self.hidden_size}); got {self.num_heads}",
            )
        return self


LARGE_MODEL_WEIGHT_BYTES = 100 * 2**20
"""Safetensors from which a model counts as large (≈ 25 M fp32 parameters): rollout.engine
'auto' generates with vLLM, and placement.stage_threads gives its stages every core.
Below it, fixed costs per call outweigh the kernels: on the tiny PPO workload
(benchmarks/bench_vs_single_process.py) per-stage threads ran 210 episodes/s against
259 with one thread per worker, and vLLM's step overhead exceeds hf's generate."""


def model_weight_bytes(path: str | Path | None) -> int:
    """Bytes of the *.safetensors in a model directory (0 for none, or no such path)."""
    if path is None:
        return 0
    return sum(file.stat().st_size for file in Path(path).glob("*.safetensors"))


class ModelConfig(ConfigModel):
    """The policy model; the reference starts as a copy and the critic from the same weights."""

    path: str | None = None
    """Local Hugging Face model directory; None builds the embedded tiny model."""
    dtype: Dtype = "auto"
    """Dtype of weights and compute: 'auto' is bfloat16 on a GPU with native bf16
    (Ampere and later) and float32 elsewhere, CPUs included; float32 on a GPU runs
    matmuls in TF32."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """The embedded tiny model; ignored when path is set."""


# --- data -------------------------------------------------------------------------------


class ArithmeticTaskConfig(ConfigModel):
    """The embedded verifiable task: 'a+b=' prompts, answer checked exactly."""

    kind: Literal["addition", "product_plus"] = "addition"
    """'addition': "a+b=". 'product_plus': "a*b+c=", which the tiny model answers by
    calling a calculator for a*b when the run has rollout.agent (its warm-up teaches the
    call "[calc: a*b]"; rlserve.core.embedded.tool_task), or directly without."""
    operand_max: int = Field(99, ge=1)
    """Operands are drawn from 0..operand_max inclusive."""
    train_pairs: int = Field(8000, ge=1)
    """Distinct operand tuples in the training set."""
    eval_pairs: int = Field(2000, ge=1)
    """Distinct held-out operand tuples, disjoint from the training set."""

    @model_validator(mode="after")
    def _enough_pairs(self) -> ArithmeticTaskConfig:
        available = (self.operand_max + 1) ** (2 if self.kind == "addition" else 3)
        if self.train_pairs + self.eval_pairs > available:
            raise ConfigError(
                "train_pairs",
                f"train_pairs + eval_pairs ({self.train_pairs} + {self.eval_pairs}) exceed the "
                f"{available} distinct operand tuples with operand_max={self.operand_max}; "
                "lower them or raise operand_max",
            )
        return self


class DataConfig(ConfigModel):
    """Prompts and ground truths: a jsonl/parquet file, or the embedded arithmetic task."""

    train_path: str | None = None
    """Training prompts, a .jsonl or .parquet file; None uses the embedded arithmetic task."""
    eval_path: str | None = None
    """Held-out prompts (.jsonl/.parquet); None: the embedded task's held-out pairs when
    train_path is None, else no evaluation."""
    prompt_key: str = "prompt"
    """Column (jsonl key) holding the prompt text."""
    ground_truth_key: str = "ground_truth"
    """Column (jsonl key) holding the reference answer passed to the reward."""
    tools_kwargs_key: str = "tools_kwargs"
    """Column (dotted path) of a row's arguments per tool for a multi-turn run
    (rollout.agent): an object by tool name, handed to the environment with each of that
    row's calls (VeRL's layout: extra_info.tools_kwargs). Rows without it pass none."""
    max_prompt_tokens: int = Field(64, ge=1)
    """Longest prompt, in tokens as the tokenizer encodes it (BOS included); longer ones
    are handled as long_prompts says. Plus rollout.max_new_tokens, it must fit the model's
    max_position_embeddings."""
    long_prompts: Literal["drop", "truncate_left", "truncate_right", "error"] = "drop"
    """Prompts over max_prompt_tokens: 'drop' leaves the row out; 'truncate_left' cuts
    tokens off the start and keeps the end (where a chat template puts the generation
    prompt); 'truncate_right' keeps the start and cuts the end; 'error' fails the run,
    naming the first such row. The run prints how many rows were dropped or cut."""
    arithmetic: ArithmeticTaskConfig = Field(default_factory=ArithmeticTaskConfig)
    """The embedded task; used only where train_path / eval_path is None."""

    @field_validator("train_path", "eval_path")
    @classmethod
    def _known_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            data_format(value)
        return value

    @property
    def train_format(self) -> Literal["jsonl", "parquet"] | None:
        """Format of train_path, None for the embedded task."""
        return None if self.train_path is None else data_format(self.train_path)

    @property
    def eval_format(self) -> Literal["jsonl", "parquet"] | None:
        """Format of eval_path, None when it is not set."""
        return None if self.eval_path is None else data_format(self.eval_path)
