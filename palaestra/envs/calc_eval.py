"""The calculator tool's evaluator: exact integer/fraction arithmetic on a whitelisted AST (never ``eval``), with
size bounds checked before any work that could blow up (docs/tools.md, "The calc tool")."""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, Union

MAX_CHARS = 200
MAX_NODES = 200
MAX_BITS = 332  # ~ 10**100
Number = Union[int, Fraction]

_ALLOWED_CHARS = frozenset("0123456789+-*/%() \t")


class CalcError(ValueError):
    """The expression cannot be evaluated; the message says why (shown to the model as the tool result)."""


def _bits(v: Number) -> int:
    if isinstance(v, Fraction):
        return max(v.numerator.bit_length(), v.denominator.bit_length())
    return v.bit_length()


def _checked(v: Number) -> Number:
    if isinstance(v, Fraction) and v.denominator == 1:
        v = v.numerator
    if _bits(v) > MAX_BITS:
        raise CalcError(f"result too large (more than {MAX_BITS} bits)")
    return v


def _power(base: Number, exp: Number) -> Number:
    if isinstance(exp, Fraction):
        raise CalcError("the exponent of ** must be an integer")
    if base == 0:
        if exp < 0:
            raise CalcError("division by zero")
        return 1 if exp == 0 else 0
    if base in (1, -1):
        return base ** (abs(exp) % 2)  # (+-1)**huge: only the parity matters
    # |numerator| >= 2 or denominator >= 2, so the result has at least |exp| * (bits - 1) bits
    magnitude: Number = -base if base < 0 else base
    if abs(exp) * (_bits(magnitude) - 1) > MAX_BITS:
        raise CalcError(f"result too large (more than {MAX_BITS} bits)")
    return Fraction(base) ** exp if exp < 0 else base**exp


# the character filter of evaluate() lets no other operator through (no ~, @, <<, &, |, ^, not)
_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: lambda a, b: Fraction(a) / b,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if type(node.value) is int:
            return _checked(node.value)
        raise CalcError(f"only integers are allowed, got {type(node.value).__name__} {node.value!r}"[:120])
    if isinstance(node, ast.UnaryOp):  # + or -
        val = _eval(node.operand)
        return -val if isinstance(node.op, ast.USub) else val
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalcError("division by zero")
        return _checked(_BINOPS[type(node.op)](left, right))
    raise CalcError(f"unsupported syntax: {type(node).__name__}")


def evaluate(expression: str) -> Number:
    """The exact value of ``expression`` (docs/tools.md); :class:`CalcError` if it cannot be evaluated."""
    if not isinstance(expression, str):
        raise CalcError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression too long ({len(expression)} characters, at most {MAX_CHARS})")
    if not expression.strip():
        raise CalcError("empty expression")
    if any(ch.isalpha() or ch == "_" for ch in expression):
        raise CalcError("names, calls and attributes are not allowed; use integers and + - * / // % ** ( )")
    for pos, ch in enumerate(expression):
        if ch not in _ALLOWED_CHARS:
            if ch == ".":
                raise CalcError("only integers are allowed (no decimal point)")
            raise CalcError(f"unsupported character {ch!r} at position {pos}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise CalcError("syntax error") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise CalcError(f"expression too complex ({nodes} syntax nodes, at most {MAX_NODES})")
    try:
        return _eval(tree.body)
    except RecursionError:
        raise CalcError("expression nested too deeply") from None


def run_calc(arguments: str | Mapping[str, Any] | None) -> str:
    """The ``calc`` tool: ``{"expression": "<expr>"}`` (JSON text or mapping) -> the value (``"1788"``, ``"-3"``,
    ``"7/2"``) or ``"error: <why>"``. Never raises."""
    try:
        args: Any = arguments
        if isinstance(arguments, str):
            try:
                args = json.loads(arguments) if len(arguments) <= 4 * MAX_CHARS else None
            except (ValueError, RecursionError):
                return "error: the arguments are not valid JSON"
            if args is None:
                return "error: the arguments are too long"
        expr = args.get("expression") if isinstance(args, Mapping) else None
        if not isinstance(expr, str):
            return 'error: expected arguments {"expression": "<integer expression>"}'
        return str(evaluate(expr))
    except CalcError as exc:
        return f"error: {exc}"
    except Exception as exc:  # defensive: the tool must never crash a rollout
        return f"error: cannot evaluate ({type(exc).__name__})"
