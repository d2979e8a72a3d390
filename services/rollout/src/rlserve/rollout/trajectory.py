"""A multi-turn sample as tokens, built token in, token out.

A trajectory is its prompt's ids, then turns: the ids the model generated (response
mask 1, with their log-probs), then what the tools answered rendered through the
tokenizer's chat template (mask 0, log-prob 0), and so on. Nothing the model generated
is ever decoded and encoded again, so the tokens a loss trains on are exactly the tokens
that were sampled, boundaries included (the drift peers' users report: a newline lost
at every turn, a special token split).

Observations are the template's *delta*: what rendering the conversation with one more
message (and the generation prompt for the next assistant turn) adds to rendering it
without. `ChatDeltas` computes it once per role on a fixed two-message conversation and
checks the template is append-only there (the rendering with the message starts with
the rendering without); a template that is not is refused with the fix. Only the
message's text goes through the tokenizer, between the template's own pieces.

A model turn ends as the template ends an assistant message (ChatML: `<|im_end|>\\n`).
A turn that stopped at EOS has generated part of that ending (`<|im_end|>`); one that
stopped at a tool call's closing text has generated none of it. `ChatDeltas.turn_end`
says what is missing, and the trajectory appends it with mask 0: it is the template's,
not the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONTENT_MARK = "\x00rlserve-content\x00"
"""Stands for a message's text while the template's own pieces are found around it."""


class TemplateError(ValueError):
    """A chat template rlserve cannot build token-exact turns with; says the fix."""


@dataclass
class Trajectory:
    """One sample's tokens across its turns."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: the model's turns and the observations between them."""
    response_mask: list[int] = field(default_factory=list)
    """1 on tokens the model generated, 0 on the template's and the tools'."""
    log_probs: list[float] = field(default_factory=list)
    """The engine's log-prob of each generated token, 0 elsewhere."""
    turns: int = 0
    """Model turns so far."""

    def add_model_turn(self, ids: list[int], log_probs: list[float] | None = None) -> None:
        if log_probs is not None and len(log_probs) != len(ids):
            raise ValueError(f"{len(ids)} generated ids but {len(log_probs)} log-probs")
        self.response_ids += ids
        self.response_mask += [1] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.turns += 1

    def add_context(self, ids: list[int]) -> None:
        """Tokens the model reads but did not write (a turn's end, an observation)."""
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)

    def cut_to(self, max_response_tokens: int) -> None:
        """Drops what lies past `max_response_tokens` after the prompt (context the
        template or a tool added at the end: a sample that reaches the budget ends)."""
        del self.response_ids[max_response_tokens:]
        del self.response_mask[max_response_tokens:]
        del self.log_probs[max_response_tokens:]

    @property
    def ids(self) -> list[int]:
        """What the model reads next: the prompt and everything after it."""
        return self.prompt_ids + self.response_ids


class ChatDeltas:
    """The chat template's pieces around turns, for one tokenizer (module doc)."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "the tokenizer has no chat template; multi-turn rollouts render observations "
                "through one (set tokenizer.chat_template, or save the model with one)"
            )
        self.tokenizer = tokenizer
        base = [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": CONTENT_MARK},
        ]
        rendered = self._render(base, generation_prompt=False)
        end = rendered.rfind(CONTENT_MARK)
        if end < 0:
            raise TemplateError("the chat template drops the assistant message's text")
        self.turn_end_ids = self._encode(rendered[end + len(CONTENT_MARK) :])
        """What the template puts after an assistant message's text."""
        self._base = [base[0], {"role": "assistant", "content": "answer"}]
        self._delta_cache: dict[str, tuple[str, str]] = {}

    def turn_end(self, generated_ids: list[int]) -> list[int]:
        """The part of the template's turn ending that `generated_ids` lack: all of it
        after a tool call's closing text, what follows EOS after EOS."""
        end = self.turn_end_ids
        for overlap in range(min(len(end), len(generated_ids)), 0, -1):
            if generated_ids[-overlap:] == end[:overlap]:
                return end[overlap:]
        return list(end)

    def message_ids(self, role: str, text: str, max_text_tokens: int | None = None) -> list[int]:
        """The ids of a `role` message with `text` (a tool's observation, a simulated
        user's reply), its text cut to `max_text_tokens`, followed by the next assistant
        turn's generation prompt."""
        before, after = self._delta_pieces(role)
        text_ids = self._encode(text)[:max_text_tokens]
        return self._encode(before) + text_ids + self._encode(after)

    def _delta_pieces(self, role: str) -> tuple[str, str]:
        if role not in self._delta_cache:
            without = self._render(self._base, generation_prompt=False)
            message = {"role": role, "content": CONTENT_MARK}
            with_message = self._render([*self._base, message], generation_prompt=True)
            if not with_message.startswith(without):
                raise TemplateError(
                    f"the chat template is not append-only: rendering a {role!r} message after "
                    "the conversation changes what came before it, so turns cannot be built "
                    "token-exact; use a template that renders each message on its own"
                )
            delta = with_message[len(without) :]
            if delta.count(CONTENT_MARK) != 1:
                raise TemplateError(f"the chat template does not render a {role!r} message's text")
            before, after = delta.split(CONTENT_MARK)
            self._delta_cache[role] = (before, after)
        return self._delta_cache[role]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []
