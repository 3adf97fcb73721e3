"""Runs every reward function and reward model on a batch of completions -> (N, F) rewards.

A reward function is called with keyword arguments only:
`f(prompts=..., completions=..., completion_ids=..., **dataset_columns) -> list[float | None]`,
None meaning "does not apply" (stored as NaN). Its output is checked (`reward_outputs`), so a
wrong length, a non-number, NaN or inf stops the run with the function's name instead of
poisoning the advantages.

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

As TRL does, a function also gets `trainer_state` (the Trainer's `TrainerState`), `log_extra(column,
values)` (a column of the completions table, one value per completion) and `log_metric(name,
value)` (a scalar, logged as its mean over the logging interval and processes), when its signature
takes them (by name or `**kwargs`; a function without `**kwargs` that does not name them keeps
working). What a call logs is kept only if the call succeeds (`reward_outputs.RewardLogs`). A
completion that gets None from every function is unscorable: a warning says so (advantage 0, see
`advantages`).
"""

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grpo_hf.rewards.async_rewards import AsyncRewardCalls, blocking, is_async_reward
from grpo_hf.rewards.reward_outputs import CallLog, RewardLogs, RewardOutputError, check_reward_values

logger = logging.getLogger(__name__)

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
    reward_funcs: RewardFunc | str | PreTrainedModel | list | None,
    tokenizers: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase | None] | None,
    reward_weights: list[float] | None,
    **loading,
) -> list[RewardFunc | RewardModel]:
    """The reward callables and models (ids and models loaded with `load_reward_model`'s keyword
    arguments `loading`), checked against `reward_weights` and `reward_processing_classes`
    (`tokenizers`: one, or one per function, used by reward models). None or [] give none (an
    environment's `get_reward` may be the reward)."""
    funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(reward_weights)} values for {len(funcs)} reward functions; "
            "give one weight per function."
        )
    tokenizers = _per_function(tokenizers, len(funcs))
    return [
        load_reward_model(f, tok, **loading) if isinstance(f, str | PreTrainedModel) else f
        for f, tok in zip(funcs, tokenizers, strict=True)
    ]


def reward_setup(
    reward_funcs: RewardFunc | str | PreTrainedModel | list | None,
    tokenizers: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase | None] | None,
    reward_weights: list[float] | None,
    environment_rewards: list[RewardFunc],
    **loading,
) -> tuple[list[RewardFunc | RewardModel], list[PreTrainedTokenizerBase | None], torch.Tensor]:
    """The run's reward functions (`reward_functions`; the environments' after them, weight 1 each,
    as in TRL), one tokenizer entry each (`reward_tokenizers`; None for the environments'), and the
    (F,) weights."""
    funcs = reward_functions(reward_funcs, tokenizers, reward_weights, **loading)
    tokenizers = reward_tokenizers(funcs, tokenizers) + [None] * len(environment_rewards)
    weights = (reward_weights or [1.0] * len(funcs)) + [1.0] * len(environment_rewards)
    return funcs + environment_rewards, tokenizers, torch.tensor(weights, dtype=torch.float32)


def reward_tokenizers(
    funcs: list[RewardFunc | RewardModel],
    tokenizers: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase | None] | None,
) -> list[PreTrainedTokenizerBase | None]:
    """One entry per reward function: a reward model's tokenizer, else what was given (TRL's list)."""
    given = _per_function(tokenizers, len(funcs))
    return [f.tokenizer if isinstance(f, RewardModel) else tok for f, tok in zip(funcs, given, strict=True)]


def _per_function(tokenizers: object, count: int) -> list:
    if tokenizers is None:
        return [None] * count
    tokenizers = tokenizers if isinstance(tokenizers, list | tuple) else [tokenizers]
    if len(tokenizers) != count:
        raise ValueError(
            f"reward_processing_classes has {len(tokenizers)} entries for {count} reward functions; they must "
            "match: pass one tokenizer per reward function (None where the default applies), or a single "
            "tokenizer for a single reward function."
        )
    return list(tokenizers)


def reward_name(func: RewardFunc | RewardModel) -> str:
    """The metric name of a reward: the function's `__name__` or the reward model's name."""
    return func.name if isinstance(func, RewardModel) else getattr(func, "__name__", type(func).__name__)


@dataclass
class _Batch:
    """The completions of one reward call and what every reward function is called with."""

    prompts: list
    completions: list
    completion_ids: list[list[int]]
    columns: dict[str, list]
    trainer_state: object

    def keywords(self, func: RewardFunc, call: CallLog) -> dict:
        """The call's keyword arguments; TRL's extra keywords only where `func` takes them."""
        kwargs = dict(
            prompts=self.prompts,
            completions=self.completions,
            completion_ids=self.completion_ids,
            **self.columns,
        )
        extras = {
            "trainer_state": self.trainer_state,
            "log_extra": call.log_extra,
            "log_metric": call.log_metric,
        }
        return kwargs | {key: value for key, value in extras.items() if _takes_keyword(func, key)}

    def row(self, i: int) -> "_Batch":
        """Completion i alone."""
        return _Batch(
            self.prompts[i : i + 1],
            self.completions[i : i + 1],
            self.completion_ids[i : i + 1],
            {key: column[i : i + 1] for key, column in self.columns.items()},
            self.trainer_state,
        )


def _takes_keyword(func: Callable, name: str) -> bool:
    """`func` accepts the keyword `name` (by name or through `**kwargs`)."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): pass everything, as TRL
        return True
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in parameters
    )


def score_completions(
    funcs: list[RewardFunc | RewardModel],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    error_policy: str,
    device: torch.device,
    trainer_state: object = None,
    logs: RewardLogs | None = None,
) -> tuple[torch.Tensor, int, int]:
    """(N, F) float32 rewards (NaN = does not apply), the number of completions scored 0 on error,
    and the number of batches that raised but scored one completion at a time (see the module).
    What the functions log with `log_extra` / `log_metric` is added to `logs`."""
    logs = RewardLogs(len(completions)) if logs is None else logs
    batch = _Batch(prompts, completions, completion_ids, columns, trainer_state)
    calls = {i: CallLog(reward_name(f), range(len(completions))) for i, f in enumerate(funcs)}
    async_calls = [(f, batch.keywords(f, calls[i])) for i, f in enumerate(funcs) if is_async_reward(f)]
    columns_out = []
    errors = retried = 0
    with AsyncRewardCalls(async_calls) as running:  # started now, awaited below
        for i, func in enumerate(funcs):
            if isinstance(func, RewardModel):
                values = score_with_model(func, prompts, completions)
            else:
                values, failed, batch_failed = _call_reward_function(
                    func, batch, calls[i], logs, error_policy, running
                )
                errors, retried = errors + failed, retried + batch_failed
            columns_out.append(values)
    rewards = torch.tensor(columns_out, dtype=torch.float32, device=device).T  # (N, F)
    warn_unscored(rewards, prompts, completions, columns)
    return rewards, errors, retried


def _call_reward_function(
    func: RewardFunc,
    batch: _Batch,
    call: CallLog,
    logs: RewardLogs,
    error_policy: str,
    running: AsyncRewardCalls,
) -> tuple[list[float], int, int]:
    """The function's values, completions scored 0, and 1 if the batch raised (0 otherwise)."""
    is_async = is_async_reward(func)
    name = reward_name(func)
    try:
        values = running.outcome(func) if is_async else func(**batch.keywords(func, call))
        values = check_reward_values(name, values, len(batch.completions))
        logs.keep(call)
        return values, 0, 0
    except RewardOutputError:
        raise
    except Exception as err:
        one_by_one = blocking(func, name) if is_async else func
        values, errors = _call_one_by_one(one_by_one, batch, logs, error_policy)
        if error_policy == "raise":  # every completion scored alone: the error depended on the batch
            raise RuntimeError(
                f"Reward function {name!r} raised {type(err).__name__}: {err} on a batch of "
                f"{len(batch.completions)} completions, but scored each of them alone (the error depends on the "
                "batch, or was transient; the traceback above is the batch's). Fix the function, or set "
                "reward_error_policy='retry' to use the one-at-a-time scores and count such batches in "
                "'reward_retried_batches'."
            ) from err
        return values, errors, 1


def _call_one_by_one(
    func: RewardFunc, batch: _Batch, logs: RewardLogs, error_policy: str
) -> tuple[list[float], int]:
    """Score each completion alone, to name the one that raises (or score it 0)."""
    values, errors = [], 0
    name = reward_name(func)
    for i, completion in enumerate(batch.completions):
        call = CallLog(name, range(i, i + 1))
        try:
            value = func(**batch.row(i).keywords(func, call))
        except RewardOutputError:
            raise
        except Exception as err:
            if error_policy != "zero":
                raise RuntimeError(
                    f"Reward function {name!r} raised {type(err).__name__}: {err} on completion "
                    f"{completion!r}. Fix the function, or set reward_error_policy='zero' to score such "
                    "completions 0 and count them in the 'reward_errors' metric."
                ) from err
            value, errors, call = [0.0], errors + 1, None
        values.extend(check_reward_values(name, value, 1))
        if call is not None:
            logs.keep(call)
    return values, errors


def warn_unscored(rewards: torch.Tensor, prompts: list, completions: list, columns: dict[str, list]) -> None:
    """Warn about completions that got None from every reward function (rewards (N, F)) in TRL's words,
    naming the first one's keyword arguments (its dataset columns, prompt and completion), then ours."""
    unscored = rewards.isnan().all(dim=1)  # (N,)
    if not unscored.any():
        return
    first = int(unscored.nonzero()[0, 0])
    row = {key: column[first] for key, column in columns.items()}
    row |= {"prompt": prompts[first], "completion": completions[first]}
    logger.warning(
        f"All reward functions returned None for the following kwargs:\n{row}\n"
        "Please ensure that at least one reward function returns a valid reward.\n"
        f"{int(unscored.sum())} of {len(completions)} completions got no reward. As in TRL, such a completion "
        "is left out of its group's reward mean and std and out of the logged reward, and gets advantage 0: no "
        "policy gradient, though its tokens still count in the loss (KL and entropy terms, the token normaliser)."
    )


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
