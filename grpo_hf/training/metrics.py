"""What training logs: a generation round's metrics from tensors gathered over every process, the
metrics of a logging interval and their reduction over processes, and the time of a step.

Where TRL 1.16's GRPO trainer logs a metric we compute, it is logged under TRL's name too:
`rewards/<name>/mean` (= our `reward/<name>`) and `rewards/<name>/std`, the terminated-length
statistics, `num_tokens`, `step_time`, and the clip ratios `clip_ratio/low_mean`, `high_mean`,
`region_mean` (= our `clip_ratio/low`, `high`, `region`, recorded under both names by
`policy_terms`). `reward` and `reward_std` are TRL's: the weighted reward's mean and std over the
whole batch, unscorable completions (None from every function) left out; ours, the mean of the
groups' stds, is `reward_std/group_mean`.
"""

import math
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from transformers import TrainerCallback

from grpo_hf.algorithm.advantages import combine_rewards, group_std_is_zero, nan_std
from grpo_hf.algorithm.sampler_correction import sampler_metrics
from grpo_hf.data.rollout import ScoredRound


def reward_metrics(
    rewards: torch.Tensor,
    aggregated: torch.Tensor,
    rewards_per_func: torch.Tensor,
    reward_names: list[str],
    advantages: torch.Tensor,
    num_generations: int,
) -> dict[str, float]:
    """Reward and advantage statistics of one whole generation batch (NaN: left out).

    rewards (N,) weighted sums (NaN: unscorable), aggregated (N,) the reward the advantages come
    from (`advantages.aggregate_rewards`: a group whose aggregate has no spread teaches nothing),
    rewards_per_func (N, F) with NaN where a function does not apply, advantages (N,); N counts
    every process's completions, group by group.
    """
    values = {
        "reward": rewards.nanmean().item(),
        "reward_std": nan_std(rewards).item(),
        "reward_std/group_mean": nan_std(rewards.view(-1, num_generations), dim=1).nanmean().item(),
        "frac_reward_zero_std": group_std_is_zero(aggregated, num_generations).float().mean().item(),
        "advantage/abs_mean": advantages.abs().mean().item(),
        "advantage/min": advantages.min().item(),
        "advantage/max": advantages.max().item(),
    }
    for i, name in enumerate(reward_names):
        mean = rewards_per_func[:, i].nanmean().item()
        values[f"reward/{name}"] = values[f"rewards/{name}/mean"] = mean
        values[f"rewards/{name}/std"] = nan_std(rewards_per_func[:, i]).item()
    return values


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """Length statistics of one whole generation batch: lengths (N,) the model's tokens of each
    completion, truncated (N,) True where no EOS came; terminated lengths 0 when none ended (TRL)."""
    lengths = lengths.float()  # (N,)
    terminated = lengths[~truncated.bool()]  # (T,)
    if terminated.numel() == 0:
        terminated = torch.zeros(1, device=lengths.device)
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "completions/min_terminated_length": terminated.min().item(),
        "completions/max_terminated_length": terminated.max().item(),
    }


def round_metrics(
    scored: ScoredRound,
    all_rewards: torch.Tensor,
    aggregated: torch.Tensor,
    all_advantages: torch.Tensor,
    weights: torch.Tensor,
    reward_names: list[str],
    num_generations: int,
    accelerator: Accelerator,
) -> dict[str, float]:
    """Every metric of one generation round, and its prompt + completion `tokens` over every process
    (for `num_tokens`). `scored` holds this process's rows; the rewards (N, F), their aggregate (N,)
    and the advantages (N,) are every process's. Every process must call it."""
    gather, result = accelerator.gather, scored.result
    own = result.completion_mask  # (B, C)
    if result.tool_mask is not None:
        own = own * (1 - result.tool_mask)  # the model's tokens only, tool results left out (TRL)
    lengths = gather(own.sum(dim=1).float())  # (N,)
    rewards = combine_rewards(all_rewards, weights.to(all_rewards.device))  # (N,)
    values = reward_metrics(rewards, aggregated, all_rewards, reward_names, all_advantages, num_generations)
    values |= completion_metrics(lengths, gather(result.truncated))
    values |= reduce_logged_metrics(scored.logged_metrics, accelerator)
    values["generation/tokens_per_second"] = (
        lengths.sum().item() / max(scored.seconds, 1e-9) / accelerator.num_processes
    )
    counts = torch.tensor([scored.errors, scored.retried, result.prompt_mask.sum()], device=lengths.device)
    errors, retried, prompt_tokens = gather(counts.float()).view(-1, 3).sum(dim=0).tolist()  # (3,)
    values["reward_errors"], values["reward_retried_batches"] = errors, retried
    values["tokens"] = prompt_tokens + lengths.sum().item()
    return values


def reduce_logged_metrics(local: dict[str, list[float]], accelerator: Accelerator) -> dict[str, float]:
    """The `log_metric` values of one round: each name's mean over its values on every process.

    Every process must call it; a name some process did not log counts only the others' values.
    """
    names = sorted(set(gather_object(sorted(local))))
    if not names:
        return {}
    stats = torch.tensor(
        [[sum(local.get(name, [])), len(local.get(name, []))] for name in names],
        dtype=torch.float64,
        device=accelerator.device,
    )  # (K, 2)
    totals = accelerator.reduce(stats, "sum").tolist()  # (K, 2)
    return {name: total / count for name, (total, count) in zip(names, totals, strict=True)}


class StepTimer(TrainerCallback):
    """Records `step_time` (TRL's): seconds from an optimizer step's first micro-step (generation
    included) to the end of its optimizer update."""

    def __init__(self, record: Callable[[dict[str, float]], None]):
        self.record = record
        self.start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is not None:
            self.record({"step_time": time.perf_counter() - self.start})
            self.start = None


# Logged as counts per logging interval (the same on every process), not as means of their records.
COUNTED_METRICS = frozenset({"nonfinite_steps_skipped", "sample/dropped_stale_total"})
# Logged as the largest / smallest record of the interval over every process.
MAXED_METRICS = frozenset(
    {
        "sampler/ratio_max",
        "clip_ratio/high_max",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/max",
        "sample/staleness_max",
    }
)
MINNED_METRICS = frozenset(
    {"clip_ratio/low_min", "sampler/ratio_min", "sampling/importance_sampling_ratio/min"}
)
# Loss metrics recorded once per micro-step (`record`), not as token means: the loss before the
# entropy bonus and MoE's router loss (means of micro-step values, as `loss` is, and as TRL logs
# `aux_loss`) and the extremes.
MICRO_STEP_METRICS = frozenset({"policy_loss", "aux_loss"}) | MAXED_METRICS | MINNED_METRICS
# Logged as the interval's last record (a running total, the same on every process).
LATEST_METRICS = frozenset({"num_tokens"})


def micro_step_values(
    metrics: dict[str, torch.Tensor], mask: torch.Tensor
) -> tuple[dict[str, float], dict[str, float], float]:
    """A micro-step's loss metrics on the host in one transfer (not one `.item()`, a device sync,
    each): the values recorded once per micro-step (`MICRO_STEP_METRICS`), the per-token means, and
    the number of tokens of the (B, T) loss mask they are means over."""
    scalars = {"tokens": mask.sum(), **metrics}
    values = dict(zip(scalars, torch.stack([v.float() for v in scalars.values()]).tolist(), strict=True))
    tokens = values.pop("tokens")
    once = {k: values.pop(k) for k in list(values) if k in MICRO_STEP_METRICS}
    return once, values, tokens


def loss_values(
    metrics: dict[str, torch.Tensor], old: torch.Tensor, inputs: dict, sampler_weights: torch.Tensor | None
) -> tuple[dict[str, float], dict[str, float], float]:
    """A loss pass's metrics on the host (`micro_step_values`: one transfer, not one `.item()`, a device
    sync, each) with, for completions whose sampler log-probs were recorded, how far the sampler is
    from pi_old (`sampler_correction.sampler_metrics`; `old` (B, C) pi_old, `sampler_weights` the
    correction's weights or None)."""
    mask = inputs["completion_mask"]  # (B, C)
    if "sampler_logps" in inputs:
        metrics = metrics | sampler_metrics(old, inputs["sampler_logps"], mask, sampler_weights)
    return micro_step_values(metrics, mask)


def combined_pass_values(
    passes: list[tuple[dict[str, float], dict[str, float], float]],
) -> tuple[dict[str, float], dict[str, float], float]:
    """A micro-step's `micro_step_values` from those of its passes (`token_budget`): the values
    recorded once summed (each pass's loss is its share of the micro-batch's), the extremes the
    largest / smallest, the token means weighted by the passes' tokens."""
    if len(passes) == 1:
        return passes[0]
    tokens = sum(count for _, _, count in passes)
    once: dict[str, float] = {}
    for values, _, _ in passes:
        for key, value in values.items():
            pick = max if key in MAXED_METRICS else min if key in MINNED_METRICS else lambda a, b: a + b
            once[key] = value if key not in once else pick(once[key], value)
    means = {
        key: sum(values[key] * count for _, values, count in passes) / max(tokens, 1.0)
        for key in passes[0][1]
    }
    return once, means if tokens else passes[0][1], tokens


class IntervalMetrics:
    """The metric records of the current logging interval, for "train" and "eval" apart.

    `reduce` turns one mode's records into logged values and clears them: each metric is the mean
    of its records over the interval and the processes, NaN records left out (a metric with none
    left is not logged; TRL logs None), except the counts in COUNTED_METRICS (summed over the
    interval), the extremes in MAXED_METRICS / MINNED_METRICS, the running totals in LATEST_METRICS,
    and token means (`record_token_means`: kl, entropy, clip_ratio/*, sampler/ratio_mean, sampler/kl), means over
    every token of the interval on every process rather than means of per-micro-batch means.
    """

    def __init__(self):
        self.values: dict[str, dict[str, list[float]]] = {
            "train": defaultdict(list),
            "eval": defaultdict(list),
        }
        self.token_sums: dict[str, dict[str, list[float]]] = {"train": {}, "eval": {}}  # key: [sum, tokens]

    def record(self, mode: str, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.values[mode][key].append(value)

    def record_token_means(self, mode: str, means: dict[str, float], tokens: float) -> None:
        sums = self.token_sums[mode]
        for key, mean in means.items():
            total = sums.setdefault(key, [0.0, 0.0])
            total[0] += mean * tokens
            total[1] += tokens

    def reduce(self, mode: str, accelerator: Accelerator) -> dict[str, float]:
        """The mode's logged values (the same on every process); every process must call it."""
        records = self.values[mode]
        out = {key: records.pop(key)[-1] for key in sorted(records.keys() & LATEST_METRICS)}
        for names, extreme in ((MAXED_METRICS, max), (MINNED_METRICS, min)):
            keys = sorted(records.keys() & names)
            if keys:
                local = torch.tensor([extreme(records.pop(k)) for k in keys], device=accelerator.device)
                gathered = accelerator.gather(local).view(-1, len(keys))  # (P, K)
                values = gathered.max(dim=0).values if extreme is max else gathered.min(dim=0).values
                # An extreme over no token at all (every record +-inf) is left out.
                out.update((k, v) for k, v in zip(keys, values.tolist(), strict=True) if math.isfinite(v))
        if records:
            keys = sorted(records)
            local = torch.tensor([_sum_and_count(records[k], k in COUNTED_METRICS) for k in keys])  # (K, 2)
            totals = accelerator.reduce(local.to(accelerator.device), "sum").tolist()  # (K, 2)
            out.update({k: s / n for k, (s, n) in zip(keys, totals, strict=True) if n > 0})
            records.clear()
        sums = self.token_sums[mode]
        if sums:
            keys = sorted(sums)
            local = torch.tensor([sums[k] for k in keys], device=accelerator.device)  # (K, 2)
            totals = accelerator.reduce(local, "sum").tolist()  # (K, 2): token sum, tokens
            out.update({k: s / n if n > 0 else 0.0 for k, (s, n) in zip(keys, totals, strict=True)})
            sums.clear()
        return out


def _sum_and_count(records: list[float], counted: bool) -> list[float]:
    """[sum, count] of the non-NaN records; a count metric counts once per process (its sum is the
    interval's count), so the reduced value is the mean of the processes' counts."""
    valid = [value for value in records if value == value]  # NaN != NaN
    return [sum(valid), 1.0 if counted else float(len(valid))]
