"""The calculator tool: arithmetic on numbers, evaluated from Python's own parse tree (no ``eval``)."""

from __future__ import annotations

import ast
import math
import operator

__all__ = ["calculate"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
              "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan,
              "min": min, "max": max}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_MAX_EXPONENT = 1000
_MAX_CHARS = 200


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text; a problem is reported as ``error: ...``.

    Numbers, ``+ - * / // % **`` (``^`` means ``**``), parentheses, ``pi``, ``e`` and
    ``sqrt abs round floor ceil log exp sin cos tan min max``. Thousands separators
    (``1,000``) are not numbers here: a comma separates function arguments. Exponents
    above 1000 and expressions over 200 characters are refused (they would tie a worker up).
    Whole-number results print without ``.0``.
    """
    text = expression.strip().replace("^", "**")
    if len(text) > _MAX_CHARS:
        return f"error: the expression is longer than {_MAX_CHARS} characters"
    try:
        value = _eval(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}" if str(exc) else f"error: {type(exc).__name__}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is above {_MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _FUNCTIONS[node.func.id](*[_eval(a) for a in node.args])
    raise ValueError(f"unsupported: {ast.unparse(node)}")
