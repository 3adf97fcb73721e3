"""Built-in tasks, generated locally (no hub): arithmetic and Countdown, each with a held-out split.

- `arithmetic_dataset`: "What is 37 + 45?" style questions with operations + - * on integers in
  [low, high]; `answer` is the integer result as a str. The test split holds out whole questions:
  no (a, b, op) of the test split is in the train split, and for the commutative + and * neither is
  its mirror (b, a, op), so the test set cannot be answered by memorising the train set.
- `countdown_dataset`: reach `target` from `nums` with + - * /, each number once (Countdown as in
  Stream of Search, arXiv 2404.03683; prompt in the style of TinyZero). Every problem is built from
  a random expression over its numbers, kept in the `solution` column, so every problem is solvable.
  Train and test share no (sorted nums, target) pair.

- `calculator_dataset`: arithmetic on numbers of three to five digits, which the default model
  cannot do in its head, with a `calculator` tool: an episode calls the tool and answers with its
  result. The prompt shows one worked episode (a call, its result, the answer), since a 135M model
  told about a tool in words alone did not call it once in 64 samples. Rewards: the answer's
  accuracy, and `tool_use_reward` (a call that returned without error), which gives the early
  groups, where few episodes are right, something to rank by. Train and test share no (a, op, b)
  and no mirror of one.

`TASKS` maps a task name to its dataset builder, its training rewards, its held-out accuracy
reward and its tools (none for single-turn tasks); recipes pick a task by name.
"""

import operator
import random
from collections.abc import Callable
from typing import NamedTuple

from datasets import Dataset, DatasetDict

from grpo_hf.rewards import (
    accuracy_reward,
    countdown_reward,
    evaluate_expression,
    make_format_reward,
    tool_use_reward,
)
from grpo_hf.rewards.scoring import RewardFunc

# Short, because the default model is tiny (SmolLM2-135M-Instruct) and `accuracy_reward` reads a bare
# number best.
ARITHMETIC_SYSTEM_PROMPT = "Answer with just the number."
COUNTDOWN_SYSTEM_PROMPT = "Answer with just the equation inside <answer></answer> tags."

ARITHMETIC_OPERATIONS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
_COMMUTATIVE = frozenset({"+", "*"})
_ARITHMETIC_TEMPLATES = (
    "What is {question}?",
    "Compute {question}.",
    "Calculate {question}.",
    "What is the value of {question}?",
    "{question} = ?",
)
_COUNTDOWN_TEMPLATE = (
    "Using the numbers {nums}, create an equation that equals {target}. Use each number exactly once "
    "and only + - * / and parentheses. Put the equation in <answer></answer> tags, for example "
    "<answer>(1 + 2) * 3</answer>."
)


def _chat(system_prompt: str | None, user: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return [*system, {"role": "user", "content": user}]


def _check_sizes(num_train: int, num_test: int) -> None:
    for name, value in (("num_train", num_train), ("num_test", num_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1.")


# ---------------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------------


def arithmetic_dataset(
    num_train: int = 2000,
    num_test: int = 200,
    low: int = 0,
    high: int = 50,
    operations: tuple[str, ...] = ("+",),
    seed: int = 0,
    system_prompt: str | None = ARITHMETIC_SYSTEM_PROMPT,
) -> DatasetDict:
    """Arithmetic questions `a op b` with a, b in [low, high] and op in `operations` (+ - *).

    Returns splits "train" and "test" with columns `prompt` (chat messages: the system prompt unless
    None, then the question in one of several wordings) and `answer` (the result as a str; may be
    negative for "-"). Deterministic for a seed. Held out: see the module docstring.
    """
    _check_sizes(num_train, num_test)
    if low > high:
        raise ValueError(f"low={low} must be <= high={high}.")
    unknown = [op for op in operations if op not in ARITHMETIC_OPERATIONS]
    if not operations or unknown or len(set(operations)) != len(operations):
        raise ValueError(
            f"operations={operations!r} must be distinct, non-empty, from {sorted(ARITHMETIC_OPERATIONS)}."
        )
    total = len(operations) * (high - low + 1) ** 2
    if num_train + num_test > total:
        raise ValueError(
            f"num_train + num_test = {num_train + num_test} exceeds the {total} distinct questions with "
            f"low={low}, high={high}, operations={operations!r}; lower num_train/num_test or widen low/high."
        )
    rng = random.Random(seed)
    train, test = _held_out_questions(rng, operations, low, high, num_train, num_test)
    return DatasetDict(
        {
            "train": _arithmetic_split(rng, train, system_prompt),
            "test": _arithmetic_split(rng, test, system_prompt),
        }
    )


def _held_out_questions(
    rng: random.Random, operations: tuple[str, ...], low: int, high: int, num_train: int, num_test: int
) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """Distinct (op, a, b) for train and test; no test question or its mirror (for + and *) in train."""
    width = high - low + 1
    total = len(operations) * width * width
    # Each test question excludes at most one mirror from train, so this many draws always suffice
    # unless the whole space is drawn.
    draws = rng.sample(range(total), min(total, num_train + 2 * num_test))
    test, test_keys, train = [], set(), []
    for index in draws:
        op_index, rest = divmod(index, width * width)
        a, b = (low + i for i in divmod(rest, width))
        op = operations[op_index]
        key = (op, min(a, b), max(a, b)) if op in _COMMUTATIVE else (op, a, b)
        if len(test) < num_test:
            if key not in test_keys:
                test_keys.add(key)
                test.append((op, a, b))
        elif key not in test_keys and len(train) < num_train:
            train.append((op, a, b))
    if len(train) < num_train:
        raise ValueError(
            f"Only {len(train)} train questions stay after holding out num_test={num_test} (and their "
            f"mirrors a op b / b op a); lower num_train/num_test or widen low/high."
        )
    return train, test


def _arithmetic_split(
    rng: random.Random, questions: list[tuple[str, int, int]], system_prompt: str | None
) -> Dataset:
    prompts, answers = [], []
    for op, a, b in questions:
        shown_b = f"({b})" if b < 0 else str(b)
        text = rng.choice(_ARITHMETIC_TEMPLATES).format(question=f"{a} {op} {shown_b}")
        prompts.append(_chat(system_prompt, text))
        answers.append(str(ARITHMETIC_OPERATIONS[op](a, b)))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


# ---------------------------------------------------------------------------------------------------
# Arithmetic with a calculator tool
# ---------------------------------------------------------------------------------------------------

CALCULATOR_SYSTEM_PROMPT = (
    'You have a calculator tool. To use it, write <tool_call>{"name": "calculator", "arguments": '
    '{"expression": ...}}</tool_call>. Then answer with just the number.'
)
_CALCULATOR_EXAMPLE = [
    {"role": "user", "content": "What is 1234 * 56?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 56"}}</tool_call>',
    },
    {"role": "tool", "content": "69104"},
    {"role": "assistant", "content": "69104"},
]


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression exactly.

    Args:
        expression: Non-negative integers with + - * / and parentheses, e.g. "(12 + 3) * 45".
    """
    evaluated = evaluate_expression(expression)
    if evaluated is None:
        raise ValueError(f"cannot evaluate {expression!r}; use integers, + - * / and parentheses")
    value = evaluated[0]
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def calculator_dataset(
    num_train: int = 2000,
    num_test: int = 200,
    low: int = 100,
    high: int = 99999,
    operations: tuple[str, ...] = ("+", "-", "*"),
    seed: int = 0,
) -> DatasetDict:
    """`arithmetic_dataset` questions on larger numbers, each prompt led by the calculator system
    prompt and one worked tool episode (see the module docstring). Columns `prompt`, `answer`."""
    data = arithmetic_dataset(num_train, num_test, low, high, operations, seed, system_prompt=None)
    lead = [{"role": "system", "content": CALCULATOR_SYSTEM_PROMPT}, *_CALCULATOR_EXAMPLE]
    return DatasetDict(
        {
            name: Dataset.from_dict(
                {"prompt": [lead + p for p in split["prompt"]], "answer": split["answer"]}
            )
            for name, split in data.items()
        }
    )


# ---------------------------------------------------------------------------------------------------
# Countdown
# ---------------------------------------------------------------------------------------------------


def countdown_dataset(
    num_train: int = 2000,
    num_test: int = 200,
    num_numbers: int = 3,
    max_number: int = 25,
    max_target: int = 100,
    seed: int = 0,
    system_prompt: str | None = COUNTDOWN_SYSTEM_PROMPT,
) -> DatasetDict:
    """Countdown problems: `num_numbers` numbers in [1, max_number] and a target in [1, max_target].

    Returns splits "train" and "test" with columns `prompt` (chat), `target` (int), `nums`
    (list[int], may repeat a number) and `solution` (an expression over `nums` equal to `target`).
    Intermediate results of a solution are non-negative integers (no fractions needed).
    Deterministic for a seed; train and test share no (sorted nums, target).
    """
    _check_sizes(num_train, num_test)
    if not 2 <= num_numbers <= 6:
        raise ValueError(f"num_numbers={num_numbers} must be between 2 and 6.")
    if max_number < 1:
        raise ValueError(f"max_number={max_number} must be >= 1.")
    if max_target < 1:
        raise ValueError(f"max_target={max_target} must be >= 1.")
    rng = random.Random(seed)
    wanted = num_train + num_test
    problems: dict[tuple[tuple[int, ...], int], tuple[list[int], str]] = {}
    for _ in range(50 * wanted + 1000):
        if len(problems) == wanted:
            break
        nums = [rng.randint(1, max_number) for _ in range(num_numbers)]
        target, solution = _random_solution(rng, nums)
        if 1 <= target <= max_target:
            problems.setdefault((tuple(sorted(nums)), target), (nums, solution))
    if len(problems) < wanted:
        raise ValueError(
            f"Found only {len(problems)} distinct problems for num_train + num_test = {wanted}; lower "
            f"num_train/num_test or raise max_number/max_target/num_numbers."
        )
    rows = [
        {
            "prompt": _chat(system_prompt, _COUNTDOWN_TEMPLATE.format(nums=nums, target=target)),
            "target": target,
            "nums": nums,
            "solution": solution,
        }
        for (_, target), (nums, solution) in problems.items()
    ]  # dict order is generation order, which is already random
    return DatasetDict(
        {"train": Dataset.from_list(rows[:num_train]), "test": Dataset.from_list(rows[num_train:])}
    )


def _random_solution(rng: random.Random, nums: list[int]) -> tuple[int, str]:
    """Combine random pairs with random operations until one value is left: (value, expression)."""
    items = [(n, str(n)) for n in nums]
    while len(items) > 1:
        i, j = sorted(rng.sample(range(len(items)), 2), reverse=True)
        (a, left), (b, right) = items.pop(i), items.pop(j)
        op = rng.choice("+-*/")
        if op == "/" and (b == 0 or a % b):
            op = rng.choice("+-*")  # keep every intermediate result an integer
        if op == "-" and a < b:
            (a, left), (b, right) = (b, right), (a, left)  # and non-negative
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        items.append((value, f"({left} {op} {right})"))
    value, expression = items[0]
    return value, expression[1:-1] if expression.startswith("(") else expression


# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------


class Task(NamedTuple):
    """A built-in task: `build(num_train=..., num_test=..., seed=...) -> DatasetDict`, the reward
    functions to train with, the reward whose mean on the test split is the held-out accuracy, and
    the tools episodes may call (empty: single-turn)."""

    build: Callable[..., DatasetDict]
    rewards: list[RewardFunc]
    accuracy: RewardFunc
    tools: list[Callable] = []


TASKS: dict[str, Task] = {
    "arithmetic": Task(arithmetic_dataset, [accuracy_reward], accuracy_reward),
    "countdown": Task(countdown_dataset, [countdown_reward, make_format_reward()], countdown_reward),
    "calculator": Task(calculator_dataset, [accuracy_reward, tool_use_reward], accuracy_reward, [calculator]),
}
