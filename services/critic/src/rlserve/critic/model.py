"""The value model: a causal-LM backbone with a scalar head, and its HF-format export.

Values follow the log-prob convention of rlserve.core.modeling: input_ids [B, P+R] is a
left-padded prompt then a right-padded response, and the value of response token t is
read at position P+t-1, the state just before the token is chosen (VeRL's convention).

Choices:
- The backbone is the base model of `AutoModelForCausalLM` (its `base_model`, e.g.
  `LlamaModel`); the LM head is dropped. The value head is `nn.Linear(hidden, 1)` set to
  zero, so every initial value is 0 and the backbone's gradients are 0 until the head
  has moved (the first optimizer step trains the head alone). With `critic.model_path`
  null the critic is the policy's weights plus this zero head (the embedded default's
  recipe).
- The export uses the layout of HF's `XForTokenClassification` with `num_labels=1`
  (`<base_model_prefix>.*` + `score.weight/bias`, classifier dropout 0), so a saved critic
  loads with `AutoModelForTokenClassification` and is also accepted back as `model_path`.
"""

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForTokenClassification, PretrainedConfig

from rlserve.core.modeling import DTYPES, last_hidden_state, load_causal_lm

WEIGHTS_FILE = "model.safetensors"
# Key prefix of the head in the exported (token-classification) layout.
_HEAD_PREFIX = "score."


class ValueModel(nn.Module):
    """Backbone hidden states -> one scalar per position."""

    def __init__(self, backbone: nn.Module, config: PretrainedConfig, base_model_prefix: str):
        super().__init__()
        self.backbone = backbone
        self.config = config
        self.base_model_prefix = base_model_prefix
        hidden_size = config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden_size, 1, dtype=next(backbone.parameters()).dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values at every position, float32.

        Shape: input_ids, attention_mask (B, S) -> (B, S)
        """
        hidden = last_hidden_state(self.backbone, input_ids, attention_mask)
        return self.value_head(hidden).squeeze(-1).float()

    def export_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Renames this module's state dict to the token-classification layout."""
        exported = {}
        for key, tensor in state_dict.items():
            if key.startswith("backbone."):
                new_key = f"{self.base_model_prefix}.{key.removeprefix('backbone.')}"
            elif key.startswith("value_head."):
                new_key = _HEAD_PREFIX + key.removeprefix("value_head.")
            else:
                raise KeyError(f"unexpected parameter {key!r} in the value model")
            exported[new_key] = tensor.detach().to("cpu").contiguous()
        return exported


def response_values(
    values: torch.Tensor, response_mask: torch.Tensor, response_len: int
) -> torch.Tensor:
    """The value before each response token is chosen, 0 outside the mask.

    Shape: values (B, P+R), response_mask (B, R) -> (B, R)
    """
    return values[:, -response_len - 1 : -1] * response_mask.to(values.dtype)


def _is_saved_critic(config: PretrainedConfig) -> bool:
    return config.num_labels == 1 and any(
        name.endswith("ForTokenClassification") for name in config.architectures or ()
    )


def load_value_model(path: str | Path, dtype: str = "float32") -> ValueModel:
    """From a causal-LM directory (head = 0), or from a critic this module exported."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    config = AutoConfig.from_pretrained(path)
    if _is_saved_critic(config):
        classifier = AutoModelForTokenClassification.from_pretrained(path, dtype=DTYPES[dtype])
        model = ValueModel(classifier.base_model, config, classifier.base_model_prefix)
        model.value_head.load_state_dict(classifier.score.state_dict())
        return model
    causal_lm = load_causal_lm(path, dtype)
    model = ValueModel(causal_lm.base_model, causal_lm.config, causal_lm.base_model_prefix)
    nn.init.zeros_(model.value_head.weight)
    nn.init.zeros_(model.value_head.bias)
    return model


def save_value_model(
    model: ValueModel, state_dict: dict[str, torch.Tensor], directory: Path
) -> None:
    """Writes `state_dict` (of `model`, e.g. gathered from ZeRO-3) + config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(model.export_state_dict(state_dict), str(directory / WEIGHTS_FILE))
    config = model.config.to_dict()
    config.update(
        num_labels=1,
        id2label={0: "value"},
        label2id={"value": 0},
        classifier_dropout=0.0,
        architectures=[_token_classification_name(model.config)],
    )
    AutoConfig.for_model(**config).save_pretrained(directory)


def _token_classification_name(config: PretrainedConfig) -> str:
    for name in config.architectures or ():
        if name.endswith("ForCausalLM"):
            return name.removesuffix("ForCausalLM") + "ForTokenClassification"
    return type(config).__name__.removesuffix("Config") + "ForTokenClassification"
