"""Rewards on a completion's form rather than its correctness: format, length, repetition, tool use.

TRL's names are here with TRL's signatures and metric names (`think_format_reward`,
`get_soft_overlong_punishment`, `get_repetition_penalty_reward`); `make_format_reward` and
`make_overlong_reward` are this package's parameterised forms (the latter is the same DAPO
punishment as `get_soft_overlong_punishment`, under another metric name).
"""

import re

from grpo_hf.data.tool_results import is_tool_error
from grpo_hf.rewards.scoring import RewardFunc
from grpo_hf.rewards.text import completion_text


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
    """1.0 if the completion has a tool message that is not an error (`tool_results.is_tool_error`), else 0.0."""
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


_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 if the completion starts with one `<think>...</think>` block (no second `<think>`), else 0.0
    (TRL's `think_format_reward`)."""
    return [1.0 if _THINK_FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> RewardFunc:
    """TRL's name for DAPO's soft overlong punishment (`make_overlong_reward`), logged as
    `soft_overlong_punishment_reward` as in TRL."""
    reward = make_overlong_reward(max_completion_len, soft_punish_cache)
    reward.__name__ = reward.__qualname__ = "soft_overlong_punishment_reward"
    return reward


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RewardFunc:
    """Penalty for repeated token n-grams (arXiv 2502.03373, appendix C.2; TRL's
    `get_repetition_penalty_reward`, metric name `repetition_penalty_reward`).

    (1 - unique n-grams / n-grams) * max_penalty over `completion_ids`; 0.0 for a completion with
    fewer than `ngram_size` tokens.
    """
    if max_penalty > 0:
        raise ValueError(f"get_repetition_penalty_reward: max_penalty={max_penalty} must be <= 0.")
    if ngram_size < 1:
        raise ValueError(f"get_repetition_penalty_reward: ngram_size={ngram_size} must be >= 1.")

    def repetition_penalty_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            ngrams = [tuple(ids[i : i + ngram_size]) for i in range(len(ids) - ngram_size + 1)]
            repeated = 1 - len(set(ngrams)) / len(ngrams) if ngrams else 0.0
            rewards.append(repeated * max_penalty if repeated else 0.0)
        return rewards

    return repetition_penalty_reward
