"""LoRA adapters on a causal LM (through peft): wrap, merge for inference, export.

Choices:
- Adapters on every linear layer but the LM head ("all-linear") by default, dropout 0:
  with dropout the same weights would score tokens differently in train and eval mode,
  and PPO's ratio compares exactly those two.
- The reference policy of a LoRA actor is the same module with its adapters disabled
  (`adapters_disabled`): no second copy of the weights in the process.
- Generation engines get merged weights, base + B·A·scale, computed from the layers'
  own delta (`get_delta_weight`) into a fresh state dict named like the plain model.
  The module itself is never merged in place: merge + unmerge in floating point would
  drift the frozen base a little at every weight sync.
- A checkpoint holds the adapter (peft's adapter_model.safetensors + adapter_config.json)
  next to the merged full model, so users can load either.
- ZeRO-3 partitions parameters, and the merge reads whole base weights: LoRA runs with
  ZeRO stages 0-2 (the service config refuses stage 3 with LoRA).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ADAPTER_NAME = "default"
BASE_LAYER_INFIX = ".base_layer"


def add_lora(
    model: torch.nn.Module, rank: int, alpha: float, target_modules: list[str] | str
) -> torch.nn.Module:
    """The model with trainable LoRA adapters (B = 0, so it starts equal to the base);
    every base weight frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (adapters wrapped around a base model)."""
    return hasattr(model, "get_base_model") and hasattr(model, "disable_adapter")


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Inside, the model computes as its base (the reference policy)."""
    with model.disable_adapter():
        yield


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Base + LoRA delta for every adapted layer, named as in the plain base model
    (no `base_layer`, no lora_A/lora_B entries); the module is left unchanged."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        merged[name.replace(BASE_LAYER_INFIX, "")] = tensor.detach()
    with torch.no_grad():
        for module_name, module in base.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                key = f"{module_name}.weight"
                delta = module.get_delta_weight(ADAPTER_NAME)
                merged[key] = (merged[key] + delta.to(merged[key].dtype)).detach()
    return merged


def save_adapter(model: torch.nn.Module, directory: Path) -> None:
    """peft's adapter files (adapter_model.safetensors, adapter_config.json)."""
    model.save_pretrained(str(directory), safe_serialization=True)
