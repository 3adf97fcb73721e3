"""Built-in reward functions: pure, no I/O, never raising on model text.

Contract (the trainer's, see `grpo_hf.scoring`): a reward function is called with keyword arguments
only, `f(prompts=..., completions=..., completion_ids=..., **dataset_columns)`, and returns one
float per completion, or None where it does not apply. A completion is a str (plain-text prompt) or
a list of chat messages (`completion_text` turns either into text). Parameterised rewards come from
`make_<x>_reward(...)`; the returned function's `__name__` is the metric name.

Implemented:
- `accuracy_reward`: the completion's final answer (see `extract_answer`) checked against the
  `answer` column with math-verify's `parse` + `verify`; 1.0 / 0.0.
- `make_format_reward`: 1.0 if the completion fully matches a regex (default: only an
  `<answer>...</answer>` block), else 0.0.
- `make_overlong_reward`: DAPO's soft overlong punishment (arXiv 2503.14476) on the
  completion length in tokens: 0 up to `max - cache`, linear down to -1 at `max`, -1 beyond.
- `tool_use_reward`: 1.0 if a multi-turn completion holds a tool result that is not an error
  (the model made a well-formed call to a known tool that returned), else 0.0.
- `countdown_reward`: the Countdown game (as in Stream of Search, arXiv 2404.03683) scored as in
  TinyZero, an open replication of DeepSeek-R1-Zero (arXiv 2501.12948): the equation must use
  exactly the given numbers, each once, with + - * / and parentheses, and equal the target. Departs
  from TinyZero in two ways: no 0.1 partial credit for a well-formed wrong equation (the format
  reward does that job), and the expression is evaluated by an `ast` walker in exact rational
  arithmetic, never by `eval`.

math-verify timeouts: `parse` and `verify` guard themselves with `signal.alarm`, which raises
ValueError outside the main thread (even with `raise_on_error=False`), clobbers any alarm the caller
has set, and cannot interrupt a long C call. We therefore switch them off (`parsing_timeout=None`,
`timeout_seconds=None`) and make every input cheap instead: math-verify only ever sees a short
extracted answer that passed `_is_cheap_to_verify` (length, bracket depth, small exponents, no
factorials or unknown LaTeX commands). Same behaviour in any thread; pathological answers score 0.0.
math-verify logs one warning per process saying its timeouts are off; that is expected.
"""

import ast
import functools
import re
from collections.abc import Callable
from fractions import Fraction

from math_verify import parse, verify

from grpo_hf.tools import is_tool_error

RewardFunc = Callable[..., list[float | None]]


def completion_text(completion: str | list[dict]) -> str:
    """The text of a completion: the str itself, or the joined contents of its chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(_message_text(message.get("content")) for message in completion)
    raise TypeError(f"A completion is a str or a list of chat messages, got {type(completion).__name__}.")


def final_answer_text(completion: str | list[dict]) -> str:
    """The text that holds a completion's answer: the str itself, or its last assistant message
    (in a multi-turn completion, the model's last turn, not a tool result)."""
    if isinstance(completion, list):
        turns = [m for m in completion if m.get("role", "assistant") == "assistant"]
        return _message_text(turns[-1].get("content")) if turns else ""
    return completion_text(completion)


def _message_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # Multimodal messages: a list of parts such as {"type": "text", "text": "..."}.
    return "".join(part.get("text") or "" for part in content if isinstance(part, dict))


# ---------------------------------------------------------------------------------------------------
# Final-answer extraction
# ---------------------------------------------------------------------------------------------------

_OPEN_TAG, _CLOSE_TAG = "<answer>", "</answer>"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# An ASCII number not glued to a word or a decimal point before it: "-8", "1,234", "3.5", "3/4".
_NUMBER = re.compile(r"(?<![\w.])-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
# An operation left undone: an operator between two operands ("37 + 45", "2 \times 3", "(3+4)*2").
# A fraction's "/" is not one: "3/4" is an answer.
_OPERATION = re.compile(r"[0-9)}.]\s*(?:[-+*×·÷^]|\\times|\\cdot|\\div)\s*[0-9({\\.]")
_PLAIN_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?(?:/[0-9]+)?")
_WORD = re.compile(r"[A-Za-z]{2,}")


def answer_tag_content(text: str) -> str | None:
    """Content of the last complete `<answer>...</answer>` pair, or None if there is none."""
    close = text.rfind(_CLOSE_TAG)
    start = text.rfind(_OPEN_TAG, 0, close) if close >= 0 else -1
    return text[start + len(_OPEN_TAG) : close] if start >= 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer of free text, or None.

    Rules, first that applies:
    1. If the text has a complete `<answer>...</answer>` pair, only the last pair's content is
       looked at (the model declared its answer there; the rest of the text is ignored).
    2. The content of the last well-formed `\\boxed{...}` (nested braces allowed).
    3. The whole region, if it is a bare one-line expression: no `=`, no word of two or more letters
       outside LaTeX commands ("82", "-8", "\\frac{1}{2}", "$0.5$.").
    4. The last number: "37 + 45 = 82" -> "82", "The answer is 82." -> "82", "1,234" -> "1234".
    """
    tagged = answer_tag_content(text)
    region = text if tagged is None else tagged
    boxed = _last_boxed(region)
    if boxed is not None:
        return boxed.strip() or None
    bare = region.strip().strip("$").strip().rstrip(".").strip().strip("$").strip()
    is_one_expression = "\n" not in bare and "=" not in bare and not _BOXED.search(bare)
    if bare and is_one_expression and not _WORD.search(_LATEX_COMMAND.sub(" ", bare)):
        return bare
    numbers = _NUMBER.findall(region)
    return numbers[-1].replace(",", "") if numbers else None


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]  # index just after each "\boxed{"
    if not starts:
        return None
    closing, stack = {}, []
    for i, char in enumerate(text):  # one pass matches every brace, so this stays linear
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            closing[stack.pop()] = i
    for start in reversed(starts):
        if start - 1 in closing:
            return text[start : closing[start - 1]]
    return None


# ---------------------------------------------------------------------------------------------------
# Accuracy (math-verify)
# ---------------------------------------------------------------------------------------------------

MAX_ANSWER_CHARS = 100
_MAX_BRACKET_DEPTH = 4  # math-verify's parse/verify time grows ~2x per nesting level of { }
_MAX_POWERS = 2
_ALLOWED_LATEX = frozenset(
    "frac dfrac tfrac sqrt cdot times div pm mp pi infty left right circ degree text mbox dots ldots "
    "cdots le leq ge geq lt gt ne neq approx cup cap emptyset varnothing quad qquad displaystyle".split()
)
_LATEX_SPACING = re.compile(r"\\[,;:! ]")
_TEXT_GROUP = re.compile(r"\\(?:text|mbox)\s*\{[^{}]*\}")
# An exponent is small when it is one letter, \circ, or an integer of at most two digits.
_SMALL_EXPONENT = re.compile(
    r"(?:\^|\*\*)\s*(?:\{\s*[-+]?\s*(?:[0-9]{1,2}|[A-Za-z]|\\circ)\s*\}|[-+]?[0-9]{1,2}(?![0-9.])|[A-Za-z]|\\circ)"
)
_POWER = re.compile(r"\^|\*\*")
_CHAINED_POWER = re.compile(r"\s*(?:\^|\*\*)")


def _is_cheap_to_verify(candidate: str) -> bool:
    """True when math-verify can parse and verify `candidate` quickly (no timeout needed).

    Rejects what makes SymPy hang or crawl: long input, deep brackets, big or chained exponents
    (`9^{9^{9}}`), factorials and binomials, and any LaTeX command or function name not known to be
    harmless (`\\binom`, `\\sum`, `factorial(...)`).
    """
    if len(candidate) > MAX_ANSWER_CHARS:
        return False
    text = _LATEX_SPACING.sub(" ", candidate).replace("\\{", "{").replace("\\}", "}").replace("\\%", "%")
    if "!" in text or re.search(r"\\[^A-Za-z]", text):
        return False
    if any(name[1:] not in _ALLOWED_LATEX for name in _LATEX_COMMAND.findall(text)):
        return False
    if _WORD.search(_LATEX_COMMAND.sub(" ", _TEXT_GROUP.sub(" ", text))):
        return False  # function names such as factorial(...) or binomial(...)
    depth = max_depth = 0
    for char in text:
        if char in "({[":
            depth += 1
            max_depth = max(max_depth, depth)
        elif char in ")}]":
            depth = max(depth - 1, 0)
    if max_depth > _MAX_BRACKET_DEPTH:
        return False
    powers = list(_POWER.finditer(text))
    if len(powers) > _MAX_POWERS:
        return False
    for power in powers:
        exponent = _SMALL_EXPONENT.match(text, power.start())
        if exponent is None or _CHAINED_POWER.match(text, exponent.end()):
            return False
    return True


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    # Gold answers repeat G times per group, so parse each once. A tuple so callers cannot mutate it.
    latex = gold if "$" in gold else f"${gold}$"
    return tuple(parse(latex, parsing_timeout=None))


def _score_answer(text: str, gold: object) -> float | None:
    if gold is None:
        return None
    gold_parsed = _parse_gold(str(gold).strip())
    if not gold_parsed:
        return None  # the reference itself is unreadable: this reward cannot judge the row
    candidate = extract_answer(text)
    if candidate is None:
        return 0.0
    candidate = candidate.replace("$", "").strip()
    if not candidate or not _is_cheap_to_verify(candidate):
        return 0.0
    if _PLAIN_NUMBER.fullmatch(str(gold).strip()) and _OPERATION.search(candidate):
        return 0.0  # the question restated ("37 + 45" for 82) is not its answer, though it equals it
    try:
        predicted = parse(f"${candidate}$", parsing_timeout=None)
        correct = bool(predicted) and verify(list(gold_parsed), predicted, timeout_seconds=None)
    except Exception:  # math-verify and SymPy are large; a crash on odd text must not stop training
        return 0.0
    return 1.0 if correct else 0.0


def accuracy_reward(completions: list, answer: list[str], **kwargs) -> list[float | None]:
    """1.0 if the completion's final answer equals the `answer` column (math-verify), else 0.0.

    The final answer is taken by `extract_answer` from `final_answer_text` (for a multi-turn
    completion, the model's last turn: a tool result that holds the number does not count). Where
    the gold is a plain number, an answer with an operation left in it scores 0.0 ("37 + 45" for 82:
    math-verify would evaluate it and call it equal, so a policy could learn to restate the
    question). Unparsable, empty or pathological answers score
    0.0. A row whose `answer` is None or cannot be parsed gets None (does not apply).
    """
    return [_score_answer(final_answer_text(c), gold) for c, gold in zip(completions, answer, strict=True)]


# ---------------------------------------------------------------------------------------------------
# Format and length
# ---------------------------------------------------------------------------------------------------


def make_format_reward(
    pattern: str = r"^\s*<answer>.*?</answer>\s*$", name: str = "format_reward"
) -> RewardFunc:
    """A reward that is 1.0 when the completion fully matches `pattern` (re.DOTALL), else 0.0."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"make_format_reward: pattern {pattern!r} is not a valid regex: {err}.") from err
    if not name.isidentifier():
        raise ValueError(
            f"make_format_reward: name={name!r} must be a Python identifier (it is the metric name)."
        )

    def format_reward(completions: list, **kwargs) -> list[float | None]:
        return [1.0 if regex.fullmatch(completion_text(c)) else 0.0 for c in completions]

    format_reward.__name__ = format_reward.__qualname__ = name
    format_reward.__doc__ = f"1.0 if the completion fully matches {pattern!r}, else 0.0."
    return format_reward


def tool_use_reward(completions: list, **kwargs) -> list[float | None]:
    """1.0 if the completion has a tool message that is not an error (`tools.is_tool_error`), else 0.0."""
    return [
        float(isinstance(c, list) and any(m.get("role") == "tool" and not is_tool_error(m) for m in c))
        for c in completions
    ]


def make_overlong_reward(max_completion_length: int, soft_cache: int) -> RewardFunc:
    """DAPO soft overlong punishment (arXiv 2503.14476) on `len(completion_ids[i])` tokens.

    With L = max_completion_length and C = soft_cache: 0 if len <= L - C, (L - C - len) / C if
    L - C < len <= L (linear from 0 to -1), -1 if len > L. C = 0 is a hard cut at L.
    """
    for arg, value in (("max_completion_length", max_completion_length), ("soft_cache", soft_cache)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"make_overlong_reward: {arg} must be an int, got {value!r}.")
    if max_completion_length < 1:
        raise ValueError(f"make_overlong_reward: max_completion_length={max_completion_length} must be >= 1.")
    if not 0 <= soft_cache <= max_completion_length:
        raise ValueError(
            f"make_overlong_reward: soft_cache={soft_cache} must be between 0 and "
            f"max_completion_length={max_completion_length}."
        )
    start = max_completion_length - soft_cache

    def overlong_reward(completion_ids: list[list[int]], **kwargs) -> list[float | None]:
        rewards: list[float | None] = []
        for ids in completion_ids:
            length = len(ids)
            if length <= start:
                rewards.append(0.0)
            elif length <= max_completion_length:
                rewards.append((start - length) / soft_cache)
            else:
                rewards.append(-1.0)
        return rewards

    return overlong_reward


# ---------------------------------------------------------------------------------------------------
# Countdown
# ---------------------------------------------------------------------------------------------------

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
