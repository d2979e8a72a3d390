"""A tiny transformers Llama, randomly initialised, saved in HF format (safetensors)."""

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = 128,
    seed: int = 0,
) -> LlamaForCausalLM:
    """About 0.67 M parameters at the defaults: fast enough to train on 2 CPU cores."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_model(model: LlamaForCausalLM, directory: Path) -> None:
    model.save_pretrained(directory, safe_serialization=True)
