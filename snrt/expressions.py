"""Integer arithmetic in YAML values: `${width * 4}`, `${(depth - 2) // 9}`."""

import ast
import keyword
import operator
import re

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


MAX_LENGTH = 1000  # characters of one expression


def evaluate(text, env):
    """Evaluate `text` (+, -, *, //, parentheses, ints and names from `env`).

    Raises ValueError saying what is not allowed or which name is unknown.
    """
    if len(text) > MAX_LENGTH:
        raise ValueError(f"the expression is {len(text)} characters long; at most {MAX_LENGTH} are allowed")
    try:
        tree = ast.parse(text.strip(), mode="eval")
        return _eval(tree.body, env)
    except SyntaxError:
        reserved = [w for w in re.findall(r"[A-Za-z_]\w*", text) if keyword.iskeyword(w)]
        if reserved:
            raise ValueError(f"'{reserved[0]}' is a reserved word, not a usable name; rename it") from None
        raise ValueError("not an expression of ints and names with + - * //") from None
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def _eval(node, env):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ValueError(f"unknown name '{node.id}'; known here: {', '.join(sorted(env)) or 'none'}")
        value = env[node.id]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"'{node.id}' is {value!r}, not a number")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, env)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, env), _eval(node.right, env)
        if isinstance(node.op, ast.FloorDiv) and right == 0:
            raise ValueError("division by zero")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"'{ast.unparse(node)}' is not allowed; use ints, names, + - * // and parentheses")
