"""The reward model kind: score at the last real token equals a direct computation."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig

from rlserve.core.embedded.tokenizer import build_char_tokenizer
from rlserve.reward.reward_model import RewardModel

PROMPTS = ["1+2=", "10+20=", "7+5=", "99+1=", "3+3="]
RESPONSES = ["3", "30", "12", "100", ""]


def test_score_at_last_real_token_equals_direct_computation(tiny_reward_model_dir, encode):
    tokenizer = build_char_tokenizer()
    input_ids, attention_mask = encode(tokenizer, PROMPTS, RESPONSES)
    assert (attention_mask[:, 0] == 0).any() and (attention_mask[:, -1] == 0).any()  # padded

    scorer = RewardModel(tiny_reward_model_dir, "float32", micro_batch_samples=2)
    scores = scorer.score(input_ids, attention_mask)

    # Direct: each row alone, unpadded, through transformers' own classifier forward
    # (which scores the last token of an unpadded sequence).
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    with torch.no_grad():
        direct = torch.stack(
            [
                model(input_ids=ids[mask.bool()].unsqueeze(0)).logits[0, 0]
                for ids, mask in zip(input_ids, attention_mask, strict=True)
            ]
        )
        naive_last_column = model.score(
            model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, -1]
        ).squeeze(-1)
    assert scores.dtype == torch.float32 and scores.shape == (5,)
    torch.testing.assert_close(scores, direct, atol=1e-5, rtol=1e-5)
    assert scores.std() > 0.1  # rows score apart, so a wrong position would show
    assert not torch.allclose(scores, naive_last_column, atol=1e-3)  # padding matters


def test_micro_batch_size_does_not_change_scores(tiny_reward_model_dir, encode):
    input_ids, attention_mask = encode(build_char_tokenizer(), PROMPTS, RESPONSES)
    one = RewardModel(tiny_reward_model_dir, "float32", 1).score(input_ids, attention_mask)
    all_at_once = RewardModel(tiny_reward_model_dir, "float32", 16).score(input_ids, attention_mask)
    torch.testing.assert_close(one, all_at_once, atol=1e-5, rtol=1e-5)


def test_auto_dtype_loads_float32_on_the_cpu(tiny_reward_model_dir, encode):
    # 'auto' is the settings' default; the replica's CPU gets exactly the float32 model.
    input_ids, attention_mask = encode(build_char_tokenizer(), PROMPTS, RESPONSES)
    auto = RewardModel(tiny_reward_model_dir, "auto", 16)
    assert auto.model.dtype == torch.float32
    explicit = RewardModel(tiny_reward_model_dir, "float32", 16)
    assert torch.equal(
        auto.score(input_ids, attention_mask), explicit.score(input_ids, attention_mask)
    )


def test_two_labels_are_rejected(tmp_path):
    from transformers import LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        intermediate_size=8,
        num_labels=2,
        pad_token_id=0,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"kinds\.model\.model_path: .* num_labels=2; a reward"):
        RewardModel(tmp_path, "float32", 4)
