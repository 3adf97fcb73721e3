"""The Countdown game's reward (as in Stream of Search, arXiv 2404.03683, scored as in TinyZero, an
open replication of DeepSeek-R1-Zero, arXiv 2501.12948): the equation must use exactly the given
numbers, each once, with + - * / and parentheses, and equal the target. Departs from TinyZero in two
ways: no 0.1 partial credit for a well-formed wrong equation (the format reward does that job), and
the expression is evaluated by an `ast` walker in exact rational arithmetic, never by `eval`
(`evaluate_expression`, also the calculator tool's arithmetic).
"""

import ast
import re
from fractions import Fraction

from grpo_hf.rewards.text import answer_tag_content, completion_text

MAX_EQUATION_CHARS = 200
_MAX_AST_DEPTH = 64
_EQUATION_CHARS = re.compile(r"[0-9+\-*/()\s]+")
_OPERATORS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__}


def extract_equation(text: str) -> str | None:
    """The equation of a Countdown answer, or None.

    Region: the last `<answer>...</answer>` content if present, else the last line with a digit.
    In it, the signs × ÷ − map to * / -, anything from the first `=` on is dropped
    ("(3 + 5) * 7 = 56" -> "(3 + 5) * 7"), and the last run of digits, + - * / ( ) and spaces that
    contains a digit is the equation ("The answer is (3 + 5) * 7." -> "(3 + 5) * 7").
    """
    region = answer_tag_content(text)
    if region is None:
        lines = [line for line in text.splitlines() if re.search(r"[0-9]", line)]
        if not lines:
            return None
        region = lines[-1]
    region = region.replace("×", "*").replace("÷", "/").replace("−", "-").split("=", 1)[0]
    runs = [run.strip() for run in _EQUATION_CHARS.findall(region) if re.search(r"[0-9]", run)]
    return runs[-1] if runs else None


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and integer literals of an arithmetic expression, or None if it is not allowed.

    Allowed: non-negative integer literals, binary + - * /, parentheses, at most
    MAX_EQUATION_CHARS characters. Everything else (names, calls, attributes, `**`, unary minus,
    floats, division by zero) gives None. Never calls eval; never raises on any str.
    """
    if len(expression) > MAX_EQUATION_CHARS or not _EQUATION_CHARS.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    literals: list[int] = []
    value = _evaluate_node(tree.body, literals, 0)
    return None if value is None else (value, literals)


def _evaluate_node(node: ast.AST, literals: list[int], depth: int) -> Fraction | None:
    if depth > _MAX_AST_DEPTH:
        return None
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass: excluded
        literals.append(node.value)
        return Fraction(node.value)
    if not isinstance(node, ast.BinOp) or not isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
        return None
    left = _evaluate_node(node.left, literals, depth + 1)
    right = _evaluate_node(node.right, literals, depth + 1)
    if left is None or right is None:
        return None
    if isinstance(node.op, ast.Div):
        return None if right == 0 else left / right
    return _OPERATORS[type(node.op)](left, right)


def _score_countdown(text: str, target: object, nums: object) -> float | None:
    if target is None or nums is None:
        return None
    equation = extract_equation(text)
    result = evaluate_expression(equation) if equation is not None else None
    if result is None:
        return 0.0
    value, used = result
    uses_each_number_once = sorted(used) == sorted(int(n) for n in nums)
    return 1.0 if uses_each_number_once and abs(value - target) <= 1e-6 else 0.0


def countdown_reward(
    completions: list, target: list[int], nums: list[list[int]], **kwargs
) -> list[float | None]:
    """1.0 if the completion's equation (see `extract_equation`) uses exactly the numbers `nums`,
    each once, with + - * / and parentheses, and equals `target` (within 1e-6); else 0.0."""
    return [
        _score_countdown(completion_text(c), t, n) for c, t, n in zip(completions, target, nums, strict=True)
    ]
