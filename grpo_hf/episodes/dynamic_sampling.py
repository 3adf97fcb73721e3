"""Dynamic sampling (DAPO, arXiv 2503.14476): a generation batch of groups that teach.

A group whose rewards are all equal has advantage 0 for every completion: it adds no policy
gradient, only KL / entropy terms and tokens to the loss's denominator, so as accuracy rises the
effective batch shrinks. With `dynamic_sampling=True` such groups are dropped and more prompts are
generated, G completions each, a whole generation batch per extra round, until the batch holds
`generation_batch_size / G` groups with a non-zero reward spread.

What is implemented, and where it departs from the paper:
- The decision uses the aggregated reward (`advantages.aggregate_rewards`: the weighted sum, or
  with `multi_objective_aggregation="normalize_then_sum"` the weighted sum of the per-group
  normalised rewards, whose spread is what the advantages see) gathered from every process, so
  every process keeps the same groups; the kept groups are then laid out in generation order
  (earliest round first) and each process takes its own contiguous share, as a regular round
  would give it.
- Extra prompts come from `data.extra_prompt_indices` (a stream: `streaming.ExtraStreamPrompts`),
  a second shuffled stream over the dataset read by `ExtraRounds`, whose position is saved in
  checkpoints (the paper's code draws further batches from the same dataloader; here the
  Trainer's epochs and step counts stay those of the regular rounds).
- `max_dynamic_sampling_rounds` caps the extra rounds (the paper's code can also stop with an
  error). When the cap is reached without enough teaching groups, the batch is filled with the
  earliest dropped groups: zero advantage, so they add KL / entropy terms and loss tokens but no
  policy gradient, exactly as they would without dynamic sampling. Teaching groups beyond the
  batch's need (from the last extra round) are discarded, as in the paper.
"""

from collections.abc import Callable
from dataclasses import replace

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from grpo_hf.algorithm.advantages import aggregate_rewards, group_std_is_zero
from grpo_hf.data.rollout import Rollout, ScoredRound
from grpo_hf.episodes.multi_turn import recorded_episodes


class ExtraRounds:
    """The prompts of the extra rounds: `source` (`streaming.extra_prompt_source`, None without a
    train dataset) read from `position` on, which checkpoints save."""

    def __init__(self, source, generation_batch_size: int, num_generations: int):
        self.source, self.position = source, 0
        self.num_generations = num_generations
        self.prompts_per_round = generation_batch_size // num_generations

    def rows(self, share: int, process_index: int) -> list[dict]:
        """This process's `share` rows of the next extra round: the stream's next prompts, G rows each."""
        prompts = self.source.take(self.position, self.prompts_per_round)
        self.position += self.prompts_per_round
        start = process_index * share
        return [row for row in prompts for _ in range(self.num_generations)][start : start + share]


def select_groups(teaching: list[bool], needed: int) -> tuple[list[int], int]:
    """Indices of the `needed` groups to keep, in generation order, and how many are fillers.

    The first `needed` teaching groups are kept; when there are fewer, the earliest groups that do
    not teach fill the rest.
    """
    keep = [i for i, t in enumerate(teaching) if t][:needed]
    fill = [i for i, t in enumerate(teaching) if not t][: needed - len(keep)]
    return sorted(keep + fill), len(fill)


def stack_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Rows of several rollouts in one, prompts re-padded on the left and completions on the right."""
    prompt_width = max(r.prompt_ids.shape[1] for r in rollouts)
    completion_width = max(r.completion_ids.shape[1] for r in rollouts)

    def cat(name: str, width: int, value: int, left: bool) -> torch.Tensor:
        parts = []
        for r in rollouts:
            tensor = getattr(r, name)  # (B, W)
            pad = (width - tensor.shape[1], 0) if left else (0, width - tensor.shape[1])
            parts.append(torch.nn.functional.pad(tensor, pad, value=value))
        return torch.cat(parts)

    recorded = all(r.sampler_logps is not None for r in rollouts)
    with_tools = all(r.tool_mask is not None for r in rollouts)
    return Rollout(
        prompt_ids=cat("prompt_ids", prompt_width, pad_token_id, left=True),  # (sum B, P)
        prompt_mask=cat("prompt_mask", prompt_width, 0, left=True),  # (sum B, P)
        completion_ids=cat("completion_ids", completion_width, pad_token_id, left=False),  # (sum B, C)
        completion_mask=cat("completion_mask", completion_width, 0, left=False),  # (sum B, C)
        truncated=torch.cat([r.truncated for r in rollouts]),  # (sum B,)
        sampler_logps=cat("sampler_logps", completion_width, 0, left=False) if recorded else None,
        tool_mask=cat("tool_mask", completion_width, 0, left=False) if with_tools else None,
    )


def take_rows(scored: ScoredRound, rows: list[int]) -> ScoredRound:
    """The given rows of a round, in the given order."""
    index = torch.tensor(rows, dtype=torch.long, device=scored.rewards_per_func.device)
    r = scored.result
    fields = (
        r.prompt_ids,
        r.prompt_mask,
        r.completion_ids,
        r.completion_mask,
        r.truncated,
        r.sampler_logps,
        r.tool_mask,
    )
    result = Rollout(*(None if t is None else t.index_select(0, index.to(t.device)) for t in fields))
    return replace(
        scored,
        result=result,
        prompts=[scored.prompts[i] for i in rows],
        completions=[scored.completions[i] for i in rows],
        extra_rows=[scored.extra_rows[i] for i in rows],
        rewards_per_func=scored.rewards_per_func.index_select(0, index),
    )


def gather_round(accelerator: Accelerator, scored: ScoredRound, pad_token_id: int) -> ScoredRound:
    """A round from every process, in global row order (errors, seconds and logged metrics stay this
    process's)."""

    def gather(tensor: torch.Tensor, value: int, left: bool = False) -> torch.Tensor:
        padded = accelerator.pad_across_processes(tensor, dim=1, pad_index=value, pad_first=left)
        return accelerator.gather(padded)  # (P * B, W)

    r = scored.result
    result = Rollout(
        gather(r.prompt_ids, pad_token_id, left=True),
        gather(r.prompt_mask, 0, left=True),
        gather(r.completion_ids, pad_token_id),
        gather(r.completion_mask, 0),
        accelerator.gather(r.truncated.long()).bool(),
        None if r.sampler_logps is None else gather(r.sampler_logps, 0),
        None if r.tool_mask is None else gather(r.tool_mask, 0),
    )
    prompts, completions, extra_rows = (
        gather_object(list(x)) for x in (scored.prompts, scored.completions, scored.extra_rows)
    )
    rewards = accelerator.gather(scored.rewards_per_func)  # (P * B, F)
    return replace(
        scored,
        result=result,
        prompts=prompts,
        completions=completions,
        rewards_per_func=rewards,
        extra_rows=extra_rows,
    )


def sample_teaching_groups(
    first: ScoredRound,
    sample_more: Callable[[], ScoredRound],
    gather: Callable[[ScoredRound], ScoredRound],
    combine: Callable[[torch.Tensor], torch.Tensor],
    num_generations: int,
    max_extra_rounds: int,
    pad_token_id: int,
    process_index: int,
) -> tuple[ScoredRound, dict[str, float]]:
    """This process's share of a generation batch of teaching groups, and the round's metrics.

    `first` is this process's part of the regular round; `sample_more()` generates and scores this
    process's part of one more round; `gather` collects a round from every process (global row
    order); `combine` turns (N, F) rewards into the (N,) aggregate a group's spread is judged on.
    Every process takes the same decisions, since they are made on gathered rewards, and calls
    `sample_more` equally often.
    """
    local_rounds = [first]
    rounds = [gather(first)]
    needed = rounds[0].rewards_per_func.shape[0] // num_generations  # groups in a generation batch
    teaching = (~group_std_is_zero(combine(rounds[0].rewards_per_func), num_generations)).tolist()
    while sum(teaching) < needed and len(rounds) <= max_extra_rounds:
        local_rounds.append(sample_more())
        rounds.append(gather(local_rounds[-1]))
        more = ~group_std_is_zero(combine(rounds[-1].rewards_per_func), num_generations)  # (groups,)
        teaching += more.tolist()
    groups, filled = select_groups(teaching, needed)
    pool = ScoredRound(
        result=stack_rollouts([r.result for r in rounds], pad_token_id),
        prompts=[p for r in rounds for p in r.prompts],
        completions=[c for r in rounds for c in r.completions],
        rewards_per_func=torch.cat([r.rewards_per_func for r in rounds]),  # (rounds * N, F)
        errors=sum(r.errors for r in local_rounds),
        retried=sum(r.retried for r in local_rounds),
        seconds=sum(r.seconds for r in local_rounds),
        extra_rows=[row for r in rounds for row in r.extra_rows],
        logged_metrics={
            name: [value for r in local_rounds for value in r.logged_metrics.get(name, [])]
            for name in dict.fromkeys(name for r in local_rounds for name in r.logged_metrics)
        },
    )
    rows = [g * num_generations + k for g in groups for k in range(num_generations)]
    share = len(first.prompts)
    kept = take_rows(pool, rows[process_index * share : (process_index + 1) * share])
    metrics = {
        "dynamic_sampling/extra_rounds": float(len(rounds) - 1),
        "dynamic_sampling/groups_dropped": float(len(teaching) - sum(teaching) - filled),
        "dynamic_sampling/groups_filled": float(filled),
    }
    # The round's tokens/s counts every generated token, not only the kept ones.
    generated = pool.result.completion_mask.sum().item()
    kept_tokens = pool.result.completion_mask[rows].sum().item()
    kept.seconds = pool.seconds * kept_tokens / max(generated, 1)
    return kept, metrics


def trainer_dynamic_sampling(trainer, first: ScoredRound) -> ScoredRound:
    """DAPO dynamic sampling in `trainer`: this process's share of a batch of groups that teach, the
    extra rounds sampled and scored as the trainer's rounds are, the metrics recorded."""
    args, accelerator, pad = trainer.args, trainer.accelerator, trainer.processing_class.pad_token_id
    weights = trainer.reward_weights.to(first.rewards_per_func.device)
    scored, metrics = sample_teaching_groups(
        first,
        sample_more=lambda: recorded_episodes(
            trainer,
            trainer._sample_and_score(
                trainer.extra_rounds.rows(len(first.prompts), accelerator.process_index)
            ),
        ),
        gather=lambda scored: gather_round(accelerator, scored, pad),
        combine=lambda rewards_per_func: aggregate_rewards(
            rewards_per_func, weights, args.num_generations, args.multi_objective_aggregation
        ),
        num_generations=args.num_generations,
        max_extra_rounds=args.max_dynamic_sampling_rounds,
        pad_token_id=pad,
        process_index=accelerator.process_index,
    )
    trainer.record(metrics)
    return scored
