"""Rule reward functions: a registry by name, plus user functions by import path.

A rule is `fn(response_text: str, ground_truth: str, **extra) -> float`; `extra` holds
the row's other non-tensor columns (prompt_text, data_source, ...). Rules that declare
no `**extra` are called with the two texts only, so a plain two-argument function works.

Shipped rules:
- `arithmetic_exact_match`: 1.0 when the stripped response equals the stripped ground
  truth (the embedded default's task; the same test its held-out evaluation uses).
- `gsm8k`: GSM8K-style "#### answer" extraction. The last "#### <number>" in the response
  is compared with the ground truth (itself either a bare number or a solution ending in
  "#### <number>") as decimal numbers, after dropping thousands commas, "$" and a
  trailing ".0"/"." (so "#### $1,200.00" equals "1200"); no "#### <number>" scores 0.

`resolve_rule(spec)` is the one place that turns a config's `rule_name` into a function:
a registered name, or "package.module:function" for a user's own rule. Unknown names
raise a ConfigError listing the registered ones.
"""

import importlib
import inspect
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from rlserve.core.config import ConfigError
from rlserve.core.embedded.evaluate import exact_match

RuleFn = Callable[..., float]

RULES: dict[str, RuleFn] = {}
"""Registered rules by name."""


def register_rule(name: str) -> Callable[[RuleFn], RuleFn]:
    """Decorator adding a rule to RULES under `name` (names must be unique)."""

    def decorate(fn: RuleFn) -> RuleFn:
        if name in RULES:
            raise ValueError(f"rule {name!r} is already registered")
        RULES[name] = fn
        return fn

    return decorate


@register_rule("arithmetic_exact_match")
def arithmetic_exact_match(response_text: str, ground_truth: str, **extra: Any) -> float:
    """1.0 when the stripped response equals the stripped ground truth, else 0.0."""
    return 1.0 if exact_match(response_text, ground_truth) else 0.0


# "####", optional spaces, optional sign and "$" (either order), then digits with
# thousands commas and an optional decimal part: "#### -$1,234.50", "####42".
_GSM8K_ANSWER = re.compile(r"####\s*([-+]?\s*\$?\s*[-+]?\d[\d,]*(?:\.\d*)?)")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last "#### <number>" in `text`, normalised; None if absent.

    Normalised: no spaces, "$", "+" or commas; a decimal part of zeros dropped
    ("72.0" -> "72", "72.50" -> "72.5"); "-0" -> "0".
    """
    found = _GSM8K_ANSWER.findall(text)
    if not found:
        return None
    return _normalise_number(found[-1])


def _normalise_number(raw: str) -> str | None:
    cleaned = re.sub(r"[\s$,+]", "", raw)
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if value == 0:
        return "0"
    # normalize() drops trailing zeros; format "f" keeps "1200" from becoming "1.2E+3".
    return format(value.normalize(), "f")


@register_rule("gsm8k")
def gsm8k(response_text: str, ground_truth: str, **extra: Any) -> float:
    """1.0 when the response's last "#### <number>" equals the ground truth's number."""
    answer = extract_gsm8k_answer(response_text)
    if answer is None:
        return 0.0
    if "####" in ground_truth:
        expected = extract_gsm8k_answer(ground_truth)
    else:
        expected = _normalise_number(ground_truth.strip())
    if expected is None:  # a non-numeric ground truth: compare the texts
        expected = ground_truth.strip()
    return 1.0 if answer == expected else 0.0


def resolve_rule(spec: str) -> RuleFn:
    """The rule named `spec`: a registered name or "package.module:function".

    Raises:
        ConfigError: unknown name (lists the registered ones), unimportable module,
            missing or non-callable attribute. The path is relative ("" = the field
            holding `spec`), so a config validator can re-root it.
    """
    if ":" not in spec:
        if spec not in RULES:
            raise ConfigError(
                "",
                f"unknown rule {spec!r}; registered rules: {', '.join(sorted(RULES))} "
                "(or give your own as 'package.module:function')",
            )
        return RULES[spec]
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError("", f"{spec!r}: an import path looks like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError("", f"cannot import module {module_name!r}: {error}") from None
    fn = getattr(module, attribute, None)
    if fn is None or not callable(fn):
        raise ConfigError("", f"module {module_name!r} has no function {attribute!r}")
    return fn


def accepts_extra(fn: RuleFn) -> bool:
    """Whether `fn` takes **extra (then it receives the row's other columns)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: be conservative
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
