"""Runs every reward function and reward model on a batch of completions -> (N, F) rewards.

A reward function is called with keyword arguments only:
`f(prompts=..., completions=..., completion_ids=..., **dataset_columns) -> list[float | None]`,
None meaning "does not apply" (stored as NaN). Any real number is a reward (Python, NumPy or a
one-element tensor, bools included). Its output is checked here, so a wrong length, a non-number,
NaN or inf stops the run with the function's name instead of poisoning the advantages.

A function that raises on a batch is called again one completion at a time, to find the completion
it fails on. What happens then is `reward_error_policy`:
- `raise` (default): the run stops with the function's name, the completion it fails on alone (if
  any does) and the batch's exception chained as the cause, even when every completion alone scores.
- `retry`: when every completion alone scores, those scores are used (for errors that depend on
  the batch or are transient); each such batch is counted in `reward_retried_batches`. A completion
  that fails alone still stops the run.
- `zero`: as `retry`, and a completion that fails alone scores 0, counted in `reward_errors`.
`async def` reward functions run concurrently with each other and with the plain ones
(`async_rewards`); their output is checked and their errors handled the same way.
"""

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grpo_hf.async_rewards import AsyncRewardCalls, blocking, is_async_reward

RewardFunc = Callable[..., list[float | None]]


@dataclass
class RewardModel:
    """A sequence-classification model scoring prompt + completion with its own tokenizer."""

    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    name: str
    chat_template_kwargs: dict = field(default_factory=dict)  # for apply_chat_template on chat prompts


def load_reward_model(
    model: str | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    model_kwargs: dict | None = None,
    tokenizer_kwargs: dict | None = None,
    chat_template_kwargs: dict | None = None,
) -> RewardModel:
    """A sequence-classification reward model (one label) with its tokenizer; `model_kwargs` and
    `tokenizer_kwargs` go to their `from_pretrained` (`trust_remote_code`, `model_init_kwargs`)."""
    if isinstance(model, str):
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model, **(tokenizer_kwargs or {}))
        model = AutoModelForSequenceClassification.from_pretrained(
            model, num_labels=1, **(model_kwargs or {})
        )
    elif tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model.name_or_path, **(tokenizer_kwargs or {}))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    model.eval().requires_grad_(False)
    return RewardModel(
        model,
        tokenizer,
        name=model.name_or_path.rstrip("/").rsplit("/", 1)[-1] or type(model).__name__,
        chat_template_kwargs=chat_template_kwargs or {},
    )


def reward_functions(
    reward_funcs: RewardFunc | str | PreTrainedModel | list,
    tokenizers: list[PreTrainedTokenizerBase | None] | None,
    reward_weights: list[float] | None,
    **loading,
) -> list[RewardFunc | RewardModel]:
    """The reward callables and models (ids and models loaded with `load_reward_model`'s keyword
    arguments `loading`), checked against `reward_weights`."""
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty; pass at least one reward function or reward model.")
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(reward_weights)} values for {len(funcs)} reward functions; "
            "give one weight per function."
        )
    return [
        load_reward_model(f, tok, **loading) if isinstance(f, str | PreTrainedModel) else f
        for f, tok in zip(funcs, tokenizers or [None] * len(funcs), strict=True)
    ]


def reward_name(func: RewardFunc | RewardModel) -> str:
    """The metric name of a reward: the function's `__name__` or the reward model's name."""
    return func.name if isinstance(func, RewardModel) else getattr(func, "__name__", type(func).__name__)


def score_completions(
    funcs: list[RewardFunc | RewardModel],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    error_policy: str,
    device: torch.device,
) -> tuple[torch.Tensor, int, int]:
    """(N, F) float32 rewards (NaN = does not apply), the number of completions scored 0 on error,
    and the number of batches that raised but scored one completion at a time (see the module)."""
    columns_out = []
    errors = retried = 0
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    with AsyncRewardCalls(funcs, kwargs) as async_calls:  # started now, awaited below
        for func in funcs:
            if isinstance(func, RewardModel):
                values = score_with_model(func, prompts, completions)
            else:
                values, failed, batch_failed = _call_reward_function(
                    func, prompts, completions, completion_ids, columns, error_policy, async_calls
                )
                errors, retried = errors + failed, retried + batch_failed
            columns_out.append(values)
    rewards = torch.tensor(columns_out, dtype=torch.float32, device=device).T  # (N, F)
    return rewards, errors, retried


def _call_reward_function(
    func: RewardFunc,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    error_policy: str,
    async_calls: AsyncRewardCalls,
) -> tuple[list[float], int, int]:
    """The function's values, completions scored 0, and 1 if the batch raised (0 otherwise)."""
    is_async = is_async_reward(func)
    try:
        if is_async:
            values = async_calls.outcome(func)
        else:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        return check_reward_values(reward_name(func), values, len(completions)), 0, 0
    except RewardOutputError:
        raise
    except Exception as err:
        one_by_one = blocking(func, reward_name(func)) if is_async else func
        values, errors = _call_one_by_one(
            one_by_one, prompts, completions, completion_ids, columns, error_policy, err
        )
        if error_policy == "raise":  # every completion scored alone: the error depended on the batch
            raise RuntimeError(
                f"Reward function {reward_name(func)!r} raised {type(err).__name__}: {err} on a batch of "
                f"{len(completions)} completions, but scored each of them alone (the error depends on the "
                "batch, or was transient; the traceback above is the batch's). Fix the function, or set "
                "reward_error_policy='retry' to use the one-at-a-time scores and count such batches in "
                "'reward_retried_batches'."
            ) from err
        return values, errors, 1


def _call_one_by_one(
    func: RewardFunc,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    error_policy: str,
    batch_error: Exception,
) -> tuple[list[float], int]:
    """Score each completion alone, to name the one that raises (or score it 0)."""
    values, errors = [], 0
    for i, completion in enumerate(completions):
        row_columns = {key: column[i : i + 1] for key, column in columns.items()}
        try:
            value = func(
                prompts=prompts[i : i + 1],
                completions=[completion],
                completion_ids=completion_ids[i : i + 1],
                **row_columns,
            )
        except Exception as err:
            if error_policy != "zero":
                raise RuntimeError(
                    f"Reward function {reward_name(func)!r} raised {type(err).__name__}: {err} on completion "
                    f"{completion!r}. Fix the function, or set reward_error_policy='zero' to score such "
                    "completions 0 and count them in the 'reward_errors' metric."
                ) from err
            value, errors = [0.0], errors + 1
        values.extend(check_reward_values(reward_name(func), value, 1))
    return values, errors


class RewardOutputError(ValueError):
    """A reward function returned something that is not one number (or None) per completion."""


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


@torch.no_grad()
def score_with_model(reward: RewardModel, prompts: list, completions: list) -> list[float]:
    """The reward model's first logit for each prompt + completion."""
    texts = [
        _join(reward.tokenizer, prompt, completion, reward.chat_template_kwargs)
        for prompt, completion in zip(prompts, completions, strict=True)
    ]
    # A chat template writes the special tokens (BOS) itself: adding them again would double BOS.
    templated = not isinstance(prompts[0], str) and reward.tokenizer.chat_template is not None
    encoded = reward.tokenizer(
        texts, return_tensors="pt", padding=True, truncation=True, add_special_tokens=not templated
    )
    device = next(reward.model.parameters()).device
    logits = reward.model(**{k: v.to(device) for k, v in encoded.items()}).logits  # (N, labels)
    return logits[:, 0].float().tolist()


def _join(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list, completion: str | list, chat_template_kwargs: dict
) -> str:
    if isinstance(prompt, str):
        return prompt + completion
    messages = prompt + completion
    if tokenizer.chat_template is not None:
        return tokenizer.apply_chat_template(messages, tokenize=False, **chat_template_kwargs)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
