"""Rewards that check a completion's answer with math-verify: `accuracy_reward`,
`reasoning_accuracy_reward` and `get_cosine_scaled_reward` (TRL's names, signatures and metric
names; the gold answer may be in TRL's `solution` column or in our tasks' `answer` column).

Where ours departs from TRL's: the answer is found by `text.extract_answer` (an `<answer>` tag, the
last `\\boxed{}`, a bare expression, else the last number), not only by LaTeX anchors, so a plain
"82" is read; where the gold is a plain number, an answer with an operation left in it scores 0.0
("37 + 45" for 82: math-verify would evaluate it and call it equal, so a policy could learn to
restate the question).

math-verify timeouts: `parse` and `verify` guard themselves with `signal.alarm`, which raises
ValueError outside the main thread (even with `raise_on_error=False`), clobbers any alarm the caller
has set, and cannot interrupt a long C call. We therefore switch them off (`parsing_timeout=None`,
`timeout_seconds=None`) and make every input cheap instead: math-verify only ever sees a short
extracted answer that passed `_is_cheap_to_verify` (length, bracket depth, small exponents, no
factorials or unknown LaTeX commands). Same behaviour in any thread; pathological answers score 0.0.
math-verify logs one warning per process saying its timeouts are off; that is expected.
"""

import functools
import math
import re
from collections.abc import Callable

from math_verify import parse, verify

from grpo_hf.rewards.scoring import RewardFunc
from grpo_hf.rewards.text import LATEX_COMMAND, WORD, extract_answer, final_answer_text

MAX_ANSWER_CHARS = 100
# An operation left undone: an operator between two operands ("37 + 45", "2 \times 3", "(3+4)*2").
# A fraction's "/" is not one: "3/4" is an answer.
_OPERATION = re.compile(r"[0-9)}.]\s*(?:[-+*×·÷^]|\\times|\\cdot|\\div)\s*[0-9({\\.]")
_PLAIN_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?(?:/[0-9]+)?")
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
    if any(name[1:] not in _ALLOWED_LATEX for name in LATEX_COMMAND.findall(text)):
        return False
    if WORD.search(LATEX_COMMAND.sub(" ", _TEXT_GROUP.sub(" ", text))):
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


def accuracy_reward(
    completions: list,
    answer: list | None = None,
    solution: list | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs,
) -> list[float | None]:
    """1.0 if the completion's final answer equals the gold answer (math-verify), else 0.0.

    The gold is the `solution` column (TRL's name) or else the `answer` column (this package's tasks).
    The final answer is taken by `extract_answer` from `final_answer_text` (for a multi-turn
    completion, the model's last turn: a tool result that holds the number does not count). Where
    the gold is a plain number, an answer with an operation left in it scores 0.0. Unparsable, empty
    or pathological answers score 0.0. A row whose gold is None or cannot be parsed gets None (does
    not apply). `log_extra` (handed over by the trainer) adds the gold and the parsed answer to the
    completions table, as TRL's does.
    """
    golds = _gold_column("accuracy_reward", answer, solution)
    texts = [final_answer_text(c) for c in completions]
    rewards = [_score_answer(text, gold) for text, gold in zip(texts, golds, strict=True)]
    _log_answers(log_extra, "solution" if solution is not None else "answer", golds, texts)
    return rewards


def reasoning_accuracy_reward(
    completions: list,
    answer: list | None = None,
    solution: list | None = None,
    reasoning_delimiters: list[str] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs,
) -> list[float | None]:
    """`accuracy_reward` on the text after the reasoning (TRL's `reasoning_accuracy_reward`).

    The answer is looked for after the first of `reasoning_delimiters` (default `["</think>"]`)
    found in the completion, after its last occurrence; a completion with none of them has not
    finished reasoning and scores 0.0 (not None: incomplete reasoning is penalised).
    """
    golds = _gold_column("reasoning_accuracy_reward", answer, solution)
    delimiters = ["</think>"] if reasoning_delimiters is None else reasoning_delimiters
    rewards, texts = [], []
    for completion, gold in zip(completions, golds, strict=True):
        text = final_answer_text(completion)
        delimiter = next((d for d in delimiters if d in text), None)
        texts.append(text.split(delimiter)[-1] if delimiter is not None else "")
        rewards.append(_score_answer(texts[-1], gold) if delimiter is not None else 0.0)
    _log_answers(log_extra, "solution" if solution is not None else "answer", golds, texts)
    return rewards


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> RewardFunc:
    """Correctness scaled by length on a cosine schedule (arXiv 2502.03373, appendix C.1; TRL's
    `get_cosine_scaled_reward`, metric name `cosine_scaled_reward`).

    With p = min(len(completion_ids) / max_len, 1): a right answer gets
    min_value_correct + (max_value_correct - min_value_correct) * (1 + cos(p * pi)) / 2 (shorter is
    better), a wrong one max_value_wrong + (min_value_wrong - max_value_wrong) * (1 + cos(p * pi)) / 2
    (a longer wrong answer is penalised less); None where `accuracy_reward` gives None.
    """
    if max_len < 1:
        raise ValueError(f"get_cosine_scaled_reward: max_len={max_len} must be >= 1.")

    def cosine_scaled_reward(
        completions: list,
        completion_ids: list[list[int]],
        answer: list | None = None,
        solution: list | None = None,
        **kwargs,
    ) -> list[float | None]:
        correct = accuracy_reward(completions, answer=answer, solution=solution)
        rewards: list[float | None] = []
        for right, ids in zip(correct, completion_ids, strict=True):
            if right is None:
                rewards.append(None)
                continue
            cosine = math.cos(min(len(ids) / max_len, 1.0) * math.pi)
            low, high = (
                (min_value_correct, max_value_correct) if right else (max_value_wrong, min_value_wrong)
            )
            rewards.append(low + 0.5 * (high - low) * (1.0 + cosine))
        return rewards

    return cosine_scaled_reward


def _gold_column(name: str, answer: list | None, solution: list | None) -> list:
    """The gold answers: the `solution` column (TRL's name, which wins when a dataset has both, as in
    TRL), else the `answer` column."""
    if solution is not None:
        return solution
    if answer is None:
        raise ValueError(
            f"{name} reads the gold answer from a 'solution' or an 'answer' column; the dataset has neither. "
            "Add one."
        )
    return answer


def _log_answers(
    log_extra: Callable[[str, list], None] | None, column: str, golds: list, texts: list
) -> None:
    """The gold and the answer read from each completion, as extra columns of the completions table."""
    if log_extra is None:
        return
    log_extra(column, [str(gold) for gold in golds])
    log_extra("answer_parsed", [extract_answer(text) or "[unparseable]" for text in texts])
