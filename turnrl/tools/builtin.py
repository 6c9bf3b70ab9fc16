"""Small ready-made tools."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from turnrl.support import python_ast

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPONENT = 1000
_MAX_LENGTH = 1000
_MAX_DIGITS = 4000


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, with numbers, + - * / // % ** and parentheses, e.g. "(2 + 3) * 4".
    """
    if len(expression) > _MAX_LENGTH:
        raise ValueError(f"expression longer than {_MAX_LENGTH} characters")
    try:
        tree = python_ast.parse_expression(expression.strip())
    except SyntaxError as e:
        raise ValueError(f"invalid expression: {e.msg}") from None
    return _format_number(_evaluate(tree))


def _evaluate(node: ast.expr) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax: {ast.unparse(node)!r} (only numbers and + - * / // % **)")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse powers whose result would be too large to compute quickly."""
    if abs(exponent) > _MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is too large (max {_MAX_EXPONENT})")
    if isinstance(base, int) and abs(base) > 1 and exponent * math.log10(abs(base)) > _MAX_DIGITS:
        raise ValueError(f"a power's result would have more than {_MAX_DIGITS} digits")


def _format_number(value: int | float | complex) -> str:
    if isinstance(value, complex):
        raise ValueError("the result is a complex number")
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:.12g}" if isinstance(value, float) else str(value)
