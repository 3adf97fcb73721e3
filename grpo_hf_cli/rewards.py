"""Reward functions by name, for `--reward_funcs`: as `trl grpo` resolves them, and every reward of
`grpo_hf.rewards`.

A name is one of `REWARD_FUNCS` or a dotted import path, `module.function`, imported with the
working directory first on `sys.path` (TRL's rule), so that `--reward_funcs my_rewards.length` finds
`./my_rewards.py`. TRL 1.16's four names mean what they mean in `trl grpo`:
`get_soft_overlong_punishment` is built with TRL's values (max_completion_len=1280,
soft_punish_cache=256). grpo-hf's factories are built with their own defaults, and
`get_cosine_scaled_reward` with `max_len=max_completion_length`. `make_overlong_reward` needs its
two lengths: build it in a module of yours and name that (`my_rewards.overlong`).
"""

import difflib
import importlib
import os
import sys
from collections.abc import Callable

from grpo_hf import GRPOConfig
from grpo_hf.rewards import (
    accuracy_reward,
    countdown_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    make_format_reward,
    reasoning_accuracy_reward,
    think_format_reward,
    tool_use_reward,
)
from grpo_hf.rewards.scoring import RewardFunc

# name -> the reward function it stands for, given the run's settings.
REWARD_FUNCS: dict[str, Callable[[GRPOConfig], RewardFunc]] = {
    # TRL 1.16's `trl grpo` names, TRL's values.
    "accuracy_reward": lambda args: accuracy_reward,
    "reasoning_accuracy_reward": lambda args: reasoning_accuracy_reward,
    "think_format_reward": lambda args: think_format_reward,
    "get_soft_overlong_punishment": lambda args: get_soft_overlong_punishment(
        max_completion_len=1280, soft_punish_cache=256
    ),
    # The rest of grpo_hf.rewards.
    "countdown_reward": lambda args: countdown_reward,
    "tool_use_reward": lambda args: tool_use_reward,
    "make_format_reward": lambda args: make_format_reward(),
    "get_repetition_penalty_reward": lambda args: get_repetition_penalty_reward(),
    "get_cosine_scaled_reward": lambda args: get_cosine_scaled_reward(max_len=args.max_completion_length),
}


def check_reward_names(names: list[str]) -> None:
    """Refuse, before anything loads, a name that is neither known nor a dotted path."""
    for name in names:
        if name not in REWARD_FUNCS and "." not in name:
            close = difflib.get_close_matches(name, list(REWARD_FUNCS), n=2)
            guess = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(
                f"--reward_funcs {name}: no such reward; {guess}use one of {sorted(REWARD_FUNCS)} or a dotted "
                "import path (module.function, found from the working directory)."
            )


def reward_funcs(names: list[str], args: GRPOConfig) -> list[RewardFunc]:
    """The reward functions `names` stand for (see the module docstring)."""
    check_reward_names(names)
    return [REWARD_FUNCS[name](args) if name in REWARD_FUNCS else _imported(name) for name in names]


def _imported(path: str) -> RewardFunc:
    module_name, attribute = path.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"--reward_funcs {path}: cannot import {module_name} (looked in {os.getcwd()} first): {error}"
        ) from error
    if not hasattr(module, attribute):
        raise ValueError(f"--reward_funcs {path}: {module_name} has no {attribute!r}.")
    return getattr(module, attribute)
