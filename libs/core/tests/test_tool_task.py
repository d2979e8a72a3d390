"""The embedded multi-turn task's data, episodes and local calculator, by hand."""

import pytest

from rlserve.core.config import ConfigError, load_config, validate_config
from rlserve.core.embedded import tool_task
from rlserve.core.embedded.tokenizer import build_char_tokenizer
from rlserve.core.inputs_config import ArithmeticTaskConfig
from rlserve.core.run_config import EMBEDDED_AGENT_CONFIG_PATH, RunConfig


def test_rows_are_distinct_triples_with_their_answers():
    train, held_out = tool_task.product_plus_rows(5, 150, 50, seed=3)
    assert len(train) == 150 and len(held_out) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        product, c = row["prompt"].rstrip("=").split("+")
        a, b = product.split("*")
        assert int(row["ground_truth"]) == int(a) * int(b) + int(c)
    with pytest.raises(ValueError, match="exceed the 216 distinct triples"):
        tool_task.product_plus_rows(5, 200, 17, seed=0)


def test_an_episode_trains_on_the_call_and_the_answer_only():
    tokenizer = build_char_tokenizer()
    ((ids, labels),) = tool_task.encode_episodes(
        [{"prompt": "12*3+4=", "ground_truth": "40"}], tokenizer
    )
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12*3+4=[calc: 12*3]=36;40"
    learned = tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != -100])
    assert learned == "[calc: 12*3]40<eos>"


def test_episode_accuracy_scores_direct_answers_and_answers_after_a_call():
    """A model taught two episodes by heart: "3*4+5=" -> "[calc: 3*4]", "=12;", "17";
    "2*2+1=" answered directly, "5" (as a policy may learn to)."""
    import torch

    from rlserve.core.embedded.model import build_tiny_llama
    from rlserve.core.embedded.warmup import encode_sft_rows

    tokenizer = build_char_tokenizer()
    called = {"prompt": "3*4+5=", "ground_truth": "17"}
    direct = {"prompt": "2*2+1=", "ground_truth": "5"}
    examples = tool_task.encode_episodes([called], tokenizer) + encode_sft_rows([direct], tokenizer)
    model = build_tiny_llama(
        tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=0
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    width = max(len(ids) for ids, _ in examples)
    ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i, _ in examples])
    labels = torch.tensor([la + [-100] * (width - len(la)) for _, la in examples])
    mask = (torch.arange(width)[None] < torch.tensor([[len(i)] for i, _ in examples])).long()
    for _ in range(300):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert tool_task.episode_accuracy(model, tokenizer, [called, direct], 12) == 1.0
    wrong = [{**called, "ground_truth": "12"}, {**direct, "ground_truth": "4"}]
    assert tool_task.episode_accuracy(model, tokenizer, wrong, 12) == 0.0


def test_the_local_calculator_answers_a_product_call_only():
    assert tool_task.local_calculator("[calc: 12*3]") == "36"
    assert tool_task.local_calculator("[calc: 12+3]") == "Error"
    assert tool_task.local_calculator("no call") == "Error"


def test_the_task_config_counts_triples_for_product_plus():
    validate_config(ArithmeticTaskConfig, {"kind": "product_plus", "operand_max": 30})
    with pytest.raises(ConfigError, match="exceed the 1000 distinct operand tuples"):
        validate_config(ArithmeticTaskConfig, {"kind": "product_plus", "operand_max": 9})


def test_the_shipped_recipe_and_its_single_turn_baseline_load():
    """configs/embedded_agent.yaml as bench_learning runs it, with and without tools:
    both pass every check a run makes before a cluster starts."""
    tools = load_config(RunConfig, EMBEDDED_AGENT_CONFIG_PATH, [])
    baseline = load_config(RunConfig, EMBEDDED_AGENT_CONFIG_PATH, ["rollout.agent=null"])
    assert tools.rollout.agent is not None and baseline.rollout.agent is None
    assert tools.data.arithmetic.kind == baseline.data.arithmetic.kind == "product_plus"
    # one generation round per step: its informative groups are what trains
    assert tools.algorithm.dynamic_sampling and tools.algorithm.dynamic_sampling_max_rounds == 1
    assert baseline.algorithm == tools.algorithm and baseline.actor == tools.actor
