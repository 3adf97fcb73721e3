"""What a reward function hands back: its values, checked, and what it logs.

`check_reward_values` turns one function's output into floats (None -> NaN, "does not apply"):
any real number is a reward (Python, NumPy or a one-element tensor, bools included); a wrong
length, a non-number, NaN or inf raises `RewardOutputError` with the function's name.

`log_extra(column, values)` and `log_metric(name, value)`, the keywords TRL hands reward functions,
are a `CallLog`'s methods: each call of a function gets its own, kept in the scoring call's
`RewardLogs` only when the call succeeds (`scoring` retries a raising batch one completion at a
time; what the failed call logged is dropped, each single call's values land on its own row).
`log_extra` keeps each value as the completions table shows it (`cell_value`: plain Python data),
so an async GRPO checkpoint holding a queued round's rows can be read back with
`torch.load(weights_only=True)` (a NumPy scalar cannot).
"""

import math
import numbers
from collections import defaultdict

import numpy as np
import torch


class RewardOutputError(ValueError):
    """A reward function returned something that is not one number (or None) per completion, or
    called `log_extra` / `log_metric` with something that cannot be logged."""


def check_reward_values(name: str, values: object, expected: int) -> list[float]:
    """Validate one reward function's output; None becomes NaN ("does not apply")."""
    if not isinstance(values, list | tuple) or len(values) != expected:
        got = f"{len(values)} values" if isinstance(values, list | tuple) else type(values).__name__
        raise RewardOutputError(
            f"Reward function {name!r} returned {got} for {expected} completions; return a list with one float (or None) per completion."
        )
    out = []
    for value in values:
        if value is None:
            out.append(math.nan)
            continue
        if not _is_real_number(value):
            raise RewardOutputError(
                f"Reward function {name!r} returned {value!r} ({type(value).__name__}); rewards must be real "
                "numbers or None."
            )
        value = float(value)
        if not math.isfinite(value):
            raise RewardOutputError(
                f"Reward function {name!r} returned {value}; rewards must be finite (use None for 'does not apply')."
            )
        out.append(value)
    return out


def _is_real_number(value: object) -> bool:
    """Python / NumPy reals and bools, and one-element real tensors or arrays."""
    if isinstance(value, numbers.Real | np.bool_):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.dtype.is_complex
    if isinstance(value, np.ndarray):
        return (
            value.size == 1
            and (np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_)
            and not np.iscomplexobj(value)
        )
    return False


def cell_value(value: object) -> object:
    """`value` as a completions-table cell: None, a bool, int, float or str as is; a NumPy value or
    tensor as the Python number (or list) it holds; then anything but those five types as its str()."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        value = value.tolist()
    return value if value is None or type(value) in (bool, int, float, str) else str(value)


class CallLog:
    """`log_extra` / `log_metric` for one call of one reward function on the completions `rows`."""

    def __init__(self, func_name: str, rows: range):
        self.func_name, self.rows = func_name, rows
        self.extra: list[tuple[str, list]] = []
        self.metrics: list[tuple[str, float]] = []

    def log_extra(self, column: str, values: list) -> None:
        """Add `column` to the completions table: one value per completion of this call."""
        values = list(values)
        if not isinstance(column, str) or len(values) != len(self.rows):
            raise RewardOutputError(
                f"Reward function {self.func_name!r} called log_extra({column!r}, ...) with {len(values)} values "
                f"for {len(self.rows)} completions; pass a column name (str) and one value per completion."
            )
        self.extra.append((column, [cell_value(value) for value in values]))

    def log_metric(self, name: str, value: float) -> None:
        """Log the number `value` as the metric `name` (its mean over the logging interval and processes)."""
        if not isinstance(name, str) or not _is_real_number(value):
            raise RewardOutputError(
                f"Reward function {self.func_name!r} called log_metric({name!r}, {value!r}); pass a metric name "
                "(str) and one real number."
            )
        self.metrics.append((name, float(value)))


class RewardLogs:
    """What the reward functions of one or more scoring calls logged through `log_extra` / `log_metric`."""

    def __init__(self, num_completions: int):
        self.extra_rows: list[dict] = [{} for _ in range(num_completions)]  # column -> value, per completion
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def keep(self, call: CallLog) -> None:
        """Keep what a call that succeeded logged."""
        for column, values in call.extra:
            for row, value in zip(call.rows, values, strict=True):
                self.extra_rows[row][column] = value
        for name, value in call.metrics:
            self.metrics[name].append(value)
