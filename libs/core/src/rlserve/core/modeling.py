"""Loading HF models/tokenizers and the per-token math every model service shares.

Sequence layout used across rlserve: input_ids [B, P+R] = left-padded prompt (P) then
right-padded response (R); attention_mask marks real tokens. Token t of the response is
predicted by the logits at position P+t-1.
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(setting: str, device: torch.device) -> str:
    """The dtype name (a key of DTYPES) a model on `device` is loaded in for a dtype
    setting: "auto" or one of DTYPES, which is kept as it is.

    "auto" is bfloat16 on a GPU with native bf16 (compute capability 8.0 and later;
    FlashAttention has no float32 kernels), else float32. Not float16
    on older GPUs: float16 training needs loss scaling, and each overflow it meets skips
    an optimizer step, silently dropping a PPO update; set float16 to accept that.
    """
    if setting != "auto":
        if setting not in DTYPES:
            raise ValueError(f"dtype: {setting!r} is not one of {['auto', *sorted(DTYPES)]}")
        return setting
    # Without emulation: older GPUs run bf16 only through slow float32 emulation.
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16"
    return "float32"


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Left padding (prompts end where generation starts); pad falls back to EOS."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a prompt's first real token is position 0.

    Shape: (B, S) -> (B, S)
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def last_hidden_state(
    backbone: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """A transformer backbone's (no LM head) last hidden states over left-padded rows,
    positions counted from each row's first real token, no KV cache.

    Shape: input_ids, attention_mask (B, S) -> (B, S, H)
    """
    return backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] without materialising the full log-softmax.

    With `response_logits`, the plain full-logits computation: services score with the
    memory-bounded rlserve.core.response_scoring, and tests check it equals this.

    Shape: logits (B, R, V), labels (B, R) -> (B, R)
    """
    logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def response_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logits that predict each response token, divided by the sampling temperature.

    Shape: input_ids, attention_mask (B, P+R) -> (B, R, V)
    """
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    logits = output.logits[:, -response_len - 1 : -1, :]
    # Sampling used logits / T; scoring with the same T keeps ratios on-policy.
    return logits / temperature if temperature not in (0.0, 1.0) else logits
