"""One round's completions, made the way the run asks, and their rewards: `sample_and_score`.

The completions come from the user's `rollout_func` (`rollout_func`), multi-turn tool episodes
(`multi_turn`; with environments, each row's episode starts in its instance), or one sampling call
of the policy (`data.rollout.sample_completions`); then every reward function scores them
(`rewards.scoring`), with the dataset's columns, the environments and what a rollout_func returned
as keyword arguments. Async GRPO's generation thread passes its own `generate` and the
`trainer_state` of its round's policy version.
"""

import time
from collections.abc import Callable

from transformers.trainer_callback import TrainerState

from grpo_hf.data import batches, rollout
from grpo_hf.data.rollout import ScoredRound
from grpo_hf.episodes.environments import EMPTY_PROMPT
from grpo_hf.episodes.multi_turn import trainer_tool_episodes
from grpo_hf.episodes.rollout_func import call_rollout_func
from grpo_hf.rewards.reward_outputs import RewardLogs
from grpo_hf.rewards.scoring import score_completions


def sample_and_score(
    trainer, rows: list[dict], generate: Callable | None, state: TrainerState
) -> ScoredRound:
    """One completion per row of `rows` (each prompt G times) from `trainer`'s policy, scored."""
    args, device = trainer.args, trainer.accelerator.device
    prompts = [row.get("prompt", EMPTY_PROMPT) for row in rows]
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    start = time.perf_counter()
    environments = names = counts = None
    if trainer.environment_pool is not None:
        environments, names, prompts = trainer.environment_pool.start_episodes(rows)
        columns["environments"] = trainer.environments = environments
    if trainer.rollout_func is not None:
        result, completions, extra = _rollout_func_round(trainer, prompts, generate)
        columns.update(extra)
    elif trainer.toolbox is not None:
        result, completions, counts = trainer_tool_episodes(trainer, prompts, environments, names, generate)
    else:
        result, completions = rollout.sample_completions(
            prompts, trainer.processing_class, generate or trainer.generate_completions, device,
            args.max_prompt_length, args.chat_template_kwargs, args.pad_to_multiple_of,
        )  # fmt: skip
    result = batches.padded_to_multiple(
        result, args.pad_to_multiple_of, trainer.processing_class.pad_token_id
    )
    seconds = time.perf_counter() - start
    completion_ids = [
        ids[mask.bool()].tolist()
        for ids, mask in zip(result.completion_ids, result.completion_mask, strict=True)
    ]
    logs = RewardLogs(len(completions))  # what the reward functions log (log_extra / log_metric)
    scores, errors, retried = score_completions(
        trainer.reward_funcs, prompts, completions, completion_ids, columns, args.reward_error_policy, device,
        trainer_state=state, logs=logs,
    )  # fmt: skip
    extras = (logs.extra_rows, logs.metrics, counts)
    return ScoredRound(result, prompts, completions, scores, errors, retried, seconds, *extras)


def _rollout_func_round(trainer, prompts: list, generate: Callable | None) -> tuple:
    """The user's rollout_func on `prompts`: its `generate_completions` calls go to `generate` on async
    GRPO's thread (this process alone), else to the trainer's generator, every process in step."""
    calls = None if generate else trainer.generator.uneven_calls(trainer.sampling, trainer.policy_version)
    trainer._thread_generate.call = generate  # what generate_completions calls on this thread
    try:
        return call_rollout_func(
            trainer.rollout_func, prompts, trainer, trainer.processing_class, trainer.eos_token_ids,
            trainer.accelerator.device, calls,
        )  # fmt: skip
    finally:
        trainer._thread_generate.call = None
