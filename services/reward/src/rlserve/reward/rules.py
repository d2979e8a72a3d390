r"""Rule reward functions: a registry by name, plus user functions by import path.

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

Rules run in linear time in their text's length. Python's `re` backtracks, so a pattern
with adjacent or nested unbounded quantifiers that can match the same characters
(`\s*\s*`, `(a+)+`) takes polynomial or exponential time on a crafted text: the
shipped patterns use possessive quantifiers only (`*+`, `?+`, which never give back
what they matched), and `check_linear_pattern` proves that shape for each of them (the
tests run it). The reward service also caps the text a rule reads and the time one call
may spend in rules (`kinds.rule.max_text_chars`, `kinds.rule.time_budget_s`).

`resolve_rule(spec)` is the one place that turns a config's `rule_name` into a function:
a registered name, or "package.module:function" for a user's own rule. Unknown names
raise a ConfigError listing the registered ones.
"""

import inspect
import re
import re._constants as sre_constants
import re._parser as sre_parse
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from rlserve.core.config import ConfigError, import_object
from rlserve.core.embedded.task import exact_match

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
# Possessive quantifiers only (see the module docstring): the three whitespace runs
# never trade characters, so "####" + 20,000 spaces + "x" fails in one pass. An attempt
# scans no "#" past its "####", so findall's attempts never overlap: linear overall.
_GSM8K_ANSWER = re.compile(r"####\s*+([-+]?+\s*+\$?+\s*+[-+]?+\d[\d,]*+(?:\.\d*+)?+)")
_THOUSANDS_AND_SIGNS = re.compile(r"[\s$,+]")
# What Decimal may parse: a plain decimal, no exponent ("1e999999999" would format as a
# billion digits), no "NaN" or "Infinity".
_PLAIN_DECIMAL = re.compile(r"-?+\d*+\.?+\d*+")
PATTERNS: tuple[re.Pattern[str], ...] = (_GSM8K_ANSWER, _THOUSANDS_AND_SIGNS, _PLAIN_DECIMAL)
"""Every regular expression the shipped rules use; each passes check_linear_pattern."""


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
    cleaned = _THOUSANDS_AND_SIGNS.sub("", raw)
    if not _PLAIN_DECIMAL.fullmatch(cleaned):
        return None
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


def check_linear_pattern(pattern: re.Pattern[str]) -> None:
    """Raises ValueError unless `pattern` matches in time linear in the text's length.

    The shape it accepts: every quantifier is possessive (`*+`, `++`, `?+`, `{m,n}+`),
    so matching never backtracks into a repetition, and no unbounded repetition holds
    another one. Then one match attempt costs at most a constant times the characters
    it scans. Backreferences, lookarounds and conditionals are refused too (they can
    rescan text). A search (`findall`) makes one attempt per start position, so it is
    linear as well only when attempts cannot rescan each other's text: true of the gsm8k
    pattern, whose attempts start at "####" and scan only spaces, signs and digits past
    it (so two attempts never overlap); the text cap bounds any other case.
    """
    _check_nodes(sre_parse.parse(pattern.pattern, pattern.flags), pattern.pattern, False)


_UNBOUNDED = sre_constants.MAXREPEAT
_BACKTRACKING_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT)
_RESCANNING = (
    sre_constants.GROUPREF,
    sre_constants.GROUPREF_EXISTS,
    sre_constants.ASSERT,
    sre_constants.ASSERT_NOT,
)


def _check_nodes(nodes: sre_parse.SubPattern, source: str, inside_unbounded: bool) -> None:
    for op, argument in nodes:
        if op in _BACKTRACKING_REPEATS:
            raise ValueError(f"{source!r}: quantifier is not possessive (add '+' after it)")
        if op in _RESCANNING:
            raise ValueError(f"{source!r}: {op} can rescan the text")
        if op is sre_constants.POSSESSIVE_REPEAT:
            _, high, body = argument
            unbounded = high == _UNBOUNDED
            if unbounded and inside_unbounded:
                raise ValueError(f"{source!r}: an unbounded repetition inside another one")
            _check_nodes(body, source, inside_unbounded or unbounded)
        elif op is sre_constants.SUBPATTERN:
            _check_nodes(argument[-1], source, inside_unbounded)
        elif op is sre_constants.ATOMIC_GROUP:
            _check_nodes(argument, source, inside_unbounded)
        elif op is sre_constants.BRANCH:
            for branch in argument[1]:
                _check_nodes(branch, source, inside_unbounded)


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
    fn = import_object(spec, "function")
    if not callable(fn):
        module_name, _, attribute = spec.partition(":")
        raise ConfigError("", f"module {module_name!r} has no function {attribute!r}")
    return fn


def accepts_extra(fn: RuleFn) -> bool:
    """Whether `fn` takes **extra (then it receives the row's other columns)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: be conservative
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
