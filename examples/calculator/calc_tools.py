"""The calculator example's tool: integer arithmetic, parsed with `ast` (never `eval`)."""

import ast
import operator

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
LIMIT = 10 ** 15   # no intermediate result beyond this: a model cannot make the tool compute for long


def _value(node) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        value = OPS[type(node.op)](_value(node.left), _value(node.right))
        if abs(value) > LIMIT:
            raise ValueError(f"a result is over {LIMIT:.0e}")
        return value
    raise ValueError("only integers, + - * and parentheses are allowed")


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression: integers, + - * and parentheses.

    Args:
        expr: the expression, for example "1234 * 56"

    >>> calc("1234 * 56"), calc("(7 - 10) * 2")
    ('69104', '-6')
    >>> calc("__import__('os')")
    Traceback (most recent call last):
    ...
    ValueError: only integers, + - * and parentheses are allowed
    """
    if len(expr) > 200:
        raise ValueError("the expression is longer than 200 characters")
    try:
        tree = ast.parse(expr.replace("×", "*").replace(",", ""), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expr[:60]!r}") from None
    return str(_value(tree.body))
