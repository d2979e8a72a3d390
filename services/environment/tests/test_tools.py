"""The calculator by hand: what it computes, what it refuses, and that it never reaches
Python beyond arithmetic."""

import asyncio

import pytest

from rlserve.environment.tools import Calculator, CalculatorError, ToolCall, format_number


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12*7+3", 87),
        (" (2+3) * -4 ", -20),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-7 % 3", 2),
        ("2**10", 1024),
        ("2**-1", 0.5),
        ("1.5*4", 6.0),
        ("+5", 5),
    ],
)
def test_it_computes_arithmetic(expression, value):
    assert Calculator().evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("2**65", "exponent 65 is over 64"),
        ("9**64 * 10**40", "over 100 digits"),
        ("(-8)**0.5", "not a real number"),
        ("1e308*10", "not finite"),
        ("2 +", "not an arithmetic expression"),
        ("__import__('os').system('true')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("(1).real", "unsupported element Attribute"),
        ("'a' * 3", "unsupported element Constant"),
        ("[1, 2]", "unsupported element List"),
        ("1 if 1 else 2", "unsupported element IfExp"),
        ("True + 1", "unsupported element Constant"),
    ],
)
def test_it_refuses_what_is_not_bounded_arithmetic(expression, problem):
    with pytest.raises(CalculatorError) as error:
        Calculator().evaluate(expression)
    assert problem in str(error.value)


def test_a_call_answers_the_number_or_the_error_as_its_observation():
    calculator = Calculator(max_expression_chars=16)

    def answer(arguments):
        return asyncio.run(calculator(ToolCall("s", arguments, {}))).observation

    assert answer({"expression": "6*7"}) == "42"
    assert answer({"expression": "1/0"}) == "Error: division by zero"
    for bad in ({}, {"expression": 42}, {"expression": "1+" * 9 + "1"}):
        with pytest.raises(ValueError, match="argument 'expression'"):
            answer(bad)


def test_numbers_read_as_a_person_writes_them():
    assert [format_number(v) for v in (42, 6.0, 3.5, -2.0, 1e20, 2**60)] == [
        "42",
        "6",
        "3.5",
        "-2",
        "1e+20",
        str(2**60),
    ]
