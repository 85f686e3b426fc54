"""The calc tool's evaluator: exact, whitelisted, bounded, and total (errors are text for the model)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Mapping
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from palaestra.envs.calc_eval import MAX_BITS, MAX_CHARS, CalcError, evaluate, run_calc


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("12*34", 408),
        ("81*92", 7452),
        ("(57+22)*4", 316),
        ("12*4-99", -51),
        (" 2 + 3 * 4 ", 14),
        ("-5//2", -3),
        ("-5%3", 1),
        ("7/2", Fraction(7, 2)),
        ("6/3", 2),
        ("1/3+1/6", Fraction(1, 2)),
        ("2**10", 1024),
        ("2**-2", Fraction(1, 4)),
        ("(-1)**(10**80)", 1),
        ("0**0", 1),
        ("0**5", 0),
        ("(-1)**2", 1),
        ("(-1)**3", -1),
        ("(-1)**-3", -1),
        ("1**-4", 1),
        ("--3", 3),
        ("+3", 3),
        ("((((1))))", 1),
        ("9" * 99, int("9" * 99)),
    ],
)
def test_exact_values(expr: str, value: int | Fraction) -> None:
    got = evaluate(expr)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"expression": "9**9**9"}, "result too large"),
        ({"expression": "2**(10**100)"}, "result too large"),
        ({"expression": "(10**50)**7"}, "result too large"),
        ({"expression": "10**99*10**99"}, "result too large"),
        ({"expression": "(2/3)**1000"}, "result too large"),
        ({"expression": "(10**99)**99999"}, "result too large"),  # refused before a 33-million-bit power
        ({"expression": "1" * (MAX_CHARS + 1)}, "expression too long"),
        ({"expression": "+".join(["1"] * 99)}, "expression too complex"),
        ({"expression": "-" * 150 + "1"}, "expression too complex"),
        ({"expression": "x+1"}, "names, calls and attributes are not allowed"),
        ({"expression": "__import__('os').system('ls')"}, "names, calls and attributes are not allowed"),
        ({"expression": "(1).real"}, "names, calls and attributes are not allowed"),
        ({"expression": "abs(-3)"}, "names, calls and attributes are not allowed"),
        ({"expression": "1.5*2"}, "only integers"),
        ({"expression": "1e9"}, "names, calls and attributes are not allowed"),
        ({"expression": "[1][0]"}, "unsupported character '['"),
        ({"expression": "1<2"}, "unsupported character '<'"),
        ({"expression": "1+"}, "syntax error"),
        ({"expression": "007"}, "syntax error"),
        ({"expression": "()"}, "unsupported syntax: Tuple"),
        ({"expression": "1/0"}, "division by zero"),
        ({"expression": "5//(3-3)"}, "division by zero"),
        ({"expression": "5%0"}, "division by zero"),
        ({"expression": "0**-1"}, "division by zero"),
        ({"expression": "2**(1/2)"}, "exponent of ** must be an integer"),
        ({"expression": "   "}, "empty expression"),
        ({"expression": 42}, 'expected arguments {"expression"'),
        ({"expr": "1+1"}, 'expected arguments {"expression"'),
        ("not json", "not valid JSON"),
        ("[" * 100_000, "too long"),
        ('["1+1"]', 'expected arguments {"expression"'),
        (None, 'expected arguments {"expression"'),
    ],
)
def test_bad_input_is_a_clear_error_text_never_an_exception(arguments: object, message: str) -> None:
    t0 = time.perf_counter()
    out = run_calc(arguments)  # type: ignore[arg-type]
    assert out.startswith("error: ") and message in out, out
    assert time.perf_counter() - t0 < 0.5  # refused before any expensive work


def test_tool_takes_json_text_or_a_mapping() -> None:
    assert run_calc('{"expression":"(57+22)*4"}') == "316"
    assert run_calc({"expression": "7/2"}) == "7/2"
    assert run_calc(json.dumps({"expression": "-3*3"})) == "-9"
    with pytest.raises(CalcError, match="must be a string"):
        evaluate(3)  # type: ignore[arg-type]


def test_bounds_hold_at_the_limit() -> None:
    assert evaluate(f"2**{MAX_BITS - 1}") == 2 ** (MAX_BITS - 1)
    with pytest.raises(CalcError, match="too large"):
        evaluate(f"2**{MAX_BITS}")
    # fractions are bounded on both sides
    with pytest.raises(CalcError, match="too large"):
        evaluate(f"1/2**{MAX_BITS - 1}/3")
    # exactly MAX_CHARS characters is allowed, one more is not
    assert evaluate(" " * (MAX_CHARS - 1) + "7") == 7
    with pytest.raises(CalcError, match=f"expression too long \\({MAX_CHARS + 1} characters"):
        evaluate(" " * MAX_CHARS + "7")
    # k ones joined by '+' make 3k - 1 syntax nodes (Expression, k Constants, k - 1 BinOps with their Add):
    # k = 67 is exactly the 200 allowed, k = 68 is 203
    assert evaluate("+".join(["1"] * 67)) == 67
    with pytest.raises(CalcError, match=r"expression too complex \(203 syntax nodes, at most 200\)"):
        evaluate("+".join(["1"] * 68))


def test_arguments_text_is_capped_at_four_times_max_chars() -> None:
    text = '{"expression": "2+2"}'
    at_cap = text + " " * (4 * MAX_CHARS - len(text))  # JSON allows trailing whitespace
    assert len(at_cap) == 800 and run_calc(at_cap) == "4"
    assert run_calc(at_cap + " ") == "error: the arguments are too long"


class _BrokenArguments(Mapping[str, Any]):
    """A mapping whose every lookup fails (the tool must still answer with text)."""

    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("boom")

    def __iter__(self) -> Iterator[str]:
        return iter(["expression"])

    def __len__(self) -> int:
        return 1


def test_an_unexpected_failure_is_error_text_too() -> None:
    assert run_calc(_BrokenArguments()) == "error: cannot evaluate (RuntimeError)"


def _stack_depth() -> int:
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return depth


def test_running_out_of_stack_is_a_clear_error() -> None:
    # 60 nested minus signs are well within the node limit but need ~60 frames; leave the tool only ~40
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(_stack_depth() + 40)
    try:
        out = run_calc({"expression": "-" * 60 + "1"})
    finally:
        sys.setrecursionlimit(old)
    assert out == "error: expression nested too deeply"
    assert run_calc({"expression": "-" * 60 + "1"}) == "1"  # with the usual stack it evaluates


# ---------------------------------------------------------------------------------------------- fuzz
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=250))
def test_tool_is_total_on_any_text(text: str) -> None:
    out = run_calc({"expression": text})
    assert isinstance(out, str) and out
    assert out.startswith("error: ") or out.lstrip("-").replace("/", "").isdigit()


ATOMS = "0123456789+-*/%() "


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ATOMS, max_size=60))
def test_tool_is_total_on_near_valid_text(text: str) -> None:
    out = run_calc({"expression": text})
    assert out.startswith("error: ") or Fraction(out) == evaluate(text)


def _exprs() -> st.SearchStrategy[str]:
    leaf = st.integers(min_value=0, max_value=10**6).map(str)
    ops = st.sampled_from(["+", "-", "*", "//", "%"])

    def grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        binary = st.tuples(inner, ops, inner).map(lambda t: f"({t[0]}{t[1]}{t[2]})")
        neg = inner.map(lambda e: f"(-{e})")
        return st.one_of(binary, neg)

    return st.recursive(leaf, grow, max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(_exprs())
def test_integer_expressions_match_python(expr: str) -> None:
    try:
        expected = eval(expr, {"__builtins__": {}})  # our own generated integer expressions only
    except ZeroDivisionError:
        assert run_calc({"expression": expr}) == "error: division by zero"
        return
    out = run_calc({"expression": expr})
    if len(expr) > MAX_CHARS or abs(expected).bit_length() > MAX_BITS:
        assert out.startswith("error: ")
    elif out.startswith("error: result too large"):  # an intermediate value exceeded the bound
        pass
    else:
        assert out == str(expected)
