"""Rule functions: hand cases, GSM8K extraction edge cases, registry and import paths."""

import pytest

from rlserve.core.config import ConfigError
from rlserve.reward.rules import (
    RULES,
    accepts_extra,
    arithmetic_exact_match,
    extract_gsm8k_answer,
    gsm8k,
    register_rule,
    resolve_rule,
)


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("42", "42", 1.0),
        ("  42\n", "42", 1.0),
        ("42", " 42 ", 1.0),
        ("42 ", "24", 0.0),
        ("4 2", "42", 0.0),
        ("", "42", 0.0),
        ("042", "42", 0.0),  # exact text, not numeric equality
    ],
)
def test_arithmetic_exact_match(response, truth, expected):
    assert arithmetic_exact_match(response, truth) == expected


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so she has 72 clips.\n#### 72", "72"),
        ("#### 1,234,567", "1234567"),
        ("#### $5", "5"),
        ("#### -$5", "-5"),
        ("#### $-5", "-5"),
        ("#### 72.0", "72"),
        ("#### 72.50", "72.5"),
        ("#### 72.", "72"),
        ("The answer is #### 18.", "18"),
        ("####42", "42"),
        ("#### 42 apples", "42"),
        ("#### 3\nwait, no: #### 4", "4"),  # the last one counts
        ("#### -0", "0"),
        ("#### +7", "7"),
        ("#### 1200", "1200"),  # no scientific notation
        ("#### 0.000", "0"),
        ("no marker 42", None),
        ("#### the answer", None),
        ("", None),
    ],
)
def test_gsm8k_extraction(text, answer):
    assert extract_gsm8k_answer(text) == answer


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("18 - 3 = 15 ... #### 18", "18", 1.0),
        ("#### 1,200", "1200", 1.0),
        ("#### $1,200.00", "1200", 1.0),
        ("#### 1200", "1,200", 1.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips...\n#### 72", 1.0),  # full solution
        ("#### 72", "#### 73", 0.0),
        ("#### 17", "18", 0.0),
        ("18", "18", 0.0),  # no "####": no answer
        ("#### 18\n#### 19", "18", 0.0),
        ("#### 0.5", ".5", 1.0),
        ("#### 5", "five", 0.0),  # non-numeric ground truth compares as text
    ],
)
def test_gsm8k_rule(response, truth, expected):
    assert gsm8k(response, truth) == expected


def test_registry_and_unknown_name_lists_registered():
    assert resolve_rule("gsm8k") is gsm8k
    assert resolve_rule("arithmetic_exact_match") is arithmetic_exact_match
    with pytest.raises(ConfigError) as error:
        resolve_rule("gsm9k")
    assert "unknown rule 'gsm9k'" in str(error.value)
    assert "arithmetic_exact_match, gsm8k" in str(error.value)


def test_register_rule_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_rule("gsm8k")(lambda response_text, ground_truth: 0.0)
    assert RULES["gsm8k"] is gsm8k


def test_user_rule_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rules_resolve.py").write_text(
        "def shout(response_text, ground_truth, **extra):\n"
        "    return float(response_text.isupper())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_rule("my_rules_resolve:shout")
    assert fn("HI", "") == 1.0 and fn("hi", "") == 0.0
    assert accepts_extra(fn)
    assert resolve_rule("operator:eq")("a", "a") is True  # any callable works
    assert not accepts_extra(resolve_rule("operator:eq"))


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("operator:no_such_fn", "module 'operator' has no function 'no_such_fn'"),
        ("operator:__doc__", "has no function '__doc__'"),
        (":fn", "an import path looks like"),
    ],
)
def test_bad_import_paths(spec, problem):
    with pytest.raises(ConfigError, match=problem):
        resolve_rule(spec)


# ---- linear time (issue 12, defect 8) ------------------------------------------------

# The gsm8k pattern before the fix: three `\s*` in a row backtrack in O(n^3) on
# "####" + n spaces + "x" (21 s at n = 2,000).
_CUBIC_GSM8K = r"####\s*([-+]?\s*\$?\s*[-+]?\d[\d,]*(?:\.\d*)?)"


def test_every_shipped_pattern_has_the_linear_shape():
    from rlserve.reward.rules import PATTERNS, check_linear_pattern

    assert PATTERNS
    for pattern in PATTERNS:
        check_linear_pattern(pattern)


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        (_CUBIC_GSM8K, "not possessive"),
        (r"(a+)+", "not possessive"),
        (r"(?:a*+)*+", "inside another"),
        (r"(?:x|(?:ab*+)++)", "inside another"),
        (r"(a)\1", "rescan"),
        (r"a(?=b)", "rescan"),
    ],
)
def test_check_linear_pattern_refuses_backtracking_shapes(pattern, problem):
    import re

    from rlserve.reward.rules import check_linear_pattern

    with pytest.raises(ValueError, match=problem):
        check_linear_pattern(re.compile(pattern))


_ADVERSARIAL = [
    "'####' + ' ' * 20000 + 'x'",
    "'####' + ' ' * 200000 + 'x'",
    "'#### ' * 40000",
    "'####' + ' -' * 20000 + 'x'",
    "'####' + ' $ ' * 20000",
    "'#### -' + ' ' * 20000 + '$' + ' ' * 20000 + 'x'",
    "'#' * 100000",
    "'#### 1' + ',' * 100000 + '.' + '5' * 100000",
]


def test_gsm8k_adversarial_texts_finish_fast():
    """Secondary check by the clock, in a child process so a regression cannot hang the
    suite: each text takes about a millisecond; the cubic pattern needed hours for the
    first one."""
    import subprocess
    import sys

    program = (
        "import time\n"
        "from rlserve.reward.rules import gsm8k\n"
        f"for text in [{', '.join(_ADVERSARIAL)}]:\n"
        "    start = time.perf_counter()\n"
        "    gsm8k(text, '1')\n"
        "    gsm8k('#### 1', text)\n"
        "    assert time.perf_counter() - start < 2.0, text[:20]\n"
    )
    done = subprocess.run([sys.executable, "-c", program], timeout=60, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("#### 5", "5e0", 0.0),  # exponents are not plain decimals: compared as text
        ("#### 5", "1e999999999", 0.0),  # would format as a billion digits
        ("#### 5", "NaN", 0.0),
        ("#### 5", " 5 ", 1.0),
    ],
)
def test_gsm8k_ground_truth_must_be_a_plain_decimal(response, truth, expected):
    assert gsm8k(response, truth) == expected
