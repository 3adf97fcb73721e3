"""`rollout_func` (TRL's experimental setting): a user function that makes the completions.

`GRPOTrainer(rollout_func=f)` calls `f(prompts, trainer)` each generation call instead of sampling
itself. `prompts` are this process's rows' prompts as the dataset holds them (text or chat
messages; each prompt repeated num_generations times, as the rows are); `f` returns a dict with,
per row, `prompt_ids` and `completion_ids` (token id lists) and `logprobs` (the sampler's log-prob
of each completion token, or None for the whole batch when it has none). Optional:
`env_mask` (per completion token, 1 where the model produced it, 0 where an environment did: those
tokens stay in the context and out of the loss, as tool results do) and `logprob_token_ids`
(accepted, unused). Every other key is a column for the reward functions, as TRL reads it: a list
gives one value per row (so it must have one per row: a list of another length is an error, as it
would leave rows without a value or drop values), anything else is the same value for every row.
Each row's `logprobs` and `env_mask` must have one value per completion token. These checks run
before the rewards and the loss, with errors naming `rollout_func` and the key.

Unlike our own rollouts, the completion is taken as returned: an EOS inside it (the end of a turn
before an environment's reply) does not end it; it counts as truncated when its last token is not
an EOS. To sample from the current policy inside `f`, call
`trainer.generate_completions(prompt_ids, prompt_mask)` (it takes the policy's new weights first
when they changed, for every backend, vLLM included). Processes may call it different numbers of
times (episodes that end at different turns): `f` runs inside the generator's `uneven_calls`, so
with a collective generator (a vLLM server, sharded weights) a process whose `f` has returned
joins the others' remaining calls with no rows.
"""

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from grpo_hf.data.rollout import Rollout, decode_completions, left_padded, right_padded

logger = logging.getLogger(__name__)

RolloutFunc = Callable[[list, Any], dict[str, Any]]
REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
_NOT_COLUMNS = (*REQUIRED, "env_mask", "logprob_token_ids")


def call_rollout_func(
    func: RolloutFunc,
    prompts: list,
    trainer: Any,
    tokenizer: PreTrainedTokenizerBase,
    eos_token_ids: list[int],
    device: torch.device,
    calls: AbstractContextManager | None = None,
) -> tuple[Rollout, list, dict[str, list]]:
    """Run `func(prompts, trainer)` inside `calls` (the generator's `uneven_calls`); its rollout, the
    decoded completions, and its extra columns."""
    with calls or nullcontext():
        output = func(prompts, trainer)
    missing = sorted(set(REQUIRED) - set(output))
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    n = len(prompts)
    for key in (*REQUIRED, "env_mask"):
        value = output.get(key)
        if value is not None and len(value) != n:
            raise ValueError(
                f"rollout_func returned {len(value)} {key!r} for {n} prompts; return one per prompt."
            )
    result = rollout_from_lists(
        output["prompt_ids"],
        output["completion_ids"],
        output["logprobs"],
        output.get("env_mask"),
        eos_token_ids,
        tokenizer.pad_token_id,
        device,
    )
    completions = decode_completions(tokenizer, result, chat=not isinstance(prompts[0], str))
    return result, completions, reward_columns(output, n)


def reward_columns(output: dict[str, Any], n: int) -> dict[str, list]:
    """The extra keys of a rollout_func output as columns of `n` rows: a list is one value per row
    (TRL's meaning), anything else the same value for every row."""
    columns = {}
    for key, value in output.items():
        if key in _NOT_COLUMNS:
            continue
        if isinstance(value, list) and len(value) != n:
            raise ValueError(
                f"rollout_func returned a list of {len(value)} for {key!r} with {n} prompts: a list is one value "
                f"per prompt (row), in the prompts' order; return {n} values, or [value] * {n} to give every row "
                "the same list (a value that is not a list already goes to every row)."
            )
        columns[key] = value if isinstance(value, list) else [value] * n
    return columns


def rollout_from_lists(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    logprobs: list[list[float | None]] | None,
    env_mask: list[list[int]] | None,
    eos_token_ids: list[int],
    pad_token_id: int,
    device: torch.device,
) -> Rollout:
    """Per-row token lists as a `Rollout`: prompts left-padded, completions right-padded, every
    returned token in the completion mask, environment tokens (env_mask 0) in `tool_mask`."""
    _check_token_rows(completion_ids, logprobs, "logprobs", "log-prob")
    _check_token_rows(
        completion_ids, env_mask, "env_mask", "mask value (1: the model's, 0: an environment's)"
    )
    if env_mask is not None and any(m not in (0, 1) for row in env_mask for m in row):
        raise ValueError("rollout_func: env_mask values must be 1 (a model token) or 0 (an environment's).")
    prompts, prompt_mask = left_padded([list(ids) for ids in prompt_ids], pad_token_id, device)  # (B, P)
    ids = right_padded(completion_ids, pad_token_id, torch.long, device)  # (B, C)
    mask = right_padded([[1] * len(row) for row in completion_ids], 0, torch.long, device)  # (B, C)
    truncated = torch.tensor(
        [not row or row[-1] not in eos_token_ids for row in completion_ids], device=device
    )
    sampler_logps = None
    if logprobs is not None and any(value is None for row in logprobs for value in row):
        logger.warning("rollout_func returned None log-probs: this batch has no sampler log-probs.")
    elif logprobs is not None:
        sampler_logps = right_padded(logprobs, 0.0, torch.float32, device)  # (B, C)
    tool_mask = None
    if env_mask is not None:
        tool_mask = right_padded(
            [[1 - int(m) for m in row] for row in env_mask], 0, torch.long, device
        )  # (B, C)
    return Rollout(prompts, prompt_mask, ids, mask, truncated, sampler_logps, tool_mask)


def _check_token_rows(completion_ids: list[list[int]], rows: list[list] | None, key: str, what: str) -> None:
    """Each row of `rows` (a per-token key of the output; None: not given) as long as its completion."""
    for row, (ids, values) in enumerate(zip(completion_ids, rows or completion_ids, strict=True)):
        if len(values) != len(ids):
            raise ValueError(
                f"rollout_func: row {row} has {len(ids)} completion_ids but {len(values)} {key}; return one "
                f"{what} per completion token."
            )
