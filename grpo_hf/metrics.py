"""What training logs: a generation round's metrics from tensors gathered over every process, the
metrics of a logging interval and their reduction over processes, and the completion table
(printed, and sent to wandb when it is a reporter)."""

import math
from collections import defaultdict

import torch
from accelerate import Accelerator

from grpo_hf.advantages import group_std_is_zero


def round_metrics(
    rewards: torch.Tensor,
    rewards_per_func: torch.Tensor,
    reward_names: list[str],
    advantages: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    num_generations: int,
) -> dict[str, float]:
    """Reward, advantage and completion-length statistics of one whole generation batch.

    rewards (N,) combined, rewards_per_func (N, F) with NaN where a function does not apply,
    advantages (N,), lengths (N,) completion tokens, truncated (N,) 1.0 where no EOS; N counts
    every process's completions, group by group.
    """
    group_std = rewards.view(-1, num_generations).std(dim=1)  # (N / G,)
    values = {
        "reward": rewards.mean().item(),
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": group_std_is_zero(rewards, num_generations).float().mean().item(),
        "advantage/abs_mean": advantages.abs().mean().item(),
        "advantage/min": advantages.min().item(),
        "advantage/max": advantages.max().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.mean().item(),
    }
    for i, name in enumerate(reward_names):
        values[f"reward/{name}"] = rewards_per_func[:, i].nanmean().item()
    return values


# Logged as counts per logging interval (the same on every process), not as means of their records.
COUNTED_METRICS = frozenset({"nonfinite_steps_skipped"})
# Logged as the largest / smallest record of the interval over every process.
MAXED_METRICS = frozenset(
    {
        "sampler/ratio_max",
        "clip_ratio/high_max",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/max",
    }
)
MINNED_METRICS = frozenset({"clip_ratio/low_min", "sampling/importance_sampling_ratio/min"})
# Loss metrics recorded once per micro-step (`record`), not as token means: the loss before the
# entropy bonus (a mean of micro-step values, as `loss` is) and the extremes.
MICRO_STEP_METRICS = frozenset({"policy_loss"}) | MAXED_METRICS | MINNED_METRICS


class IntervalMetrics:
    """The metric records of the current logging interval, for "train" and "eval" apart.

    `reduce` turns one mode's records into logged values and clears them: each metric is the mean
    of its records over the interval and the processes, except the counts in COUNTED_METRICS
    (summed over the interval), the extremes in MAXED_METRICS / MINNED_METRICS, and token means (`record_token_means`:
    kl, entropy, clip_ratio/*, sampler/ratio_mean), means over every token of the interval on every
    process rather than means of per-micro-batch means.
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
        out: dict[str, float] = {}
        records = self.values[mode]
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
            local = torch.tensor(
                [sum(records[k]) / (1 if k in COUNTED_METRICS else len(records[k])) for k in keys],
                device=accelerator.device,
            )
            out.update(zip(keys, accelerator.reduce(local, "mean").tolist(), strict=True))
            records.clear()
        sums = self.token_sums[mode]
        if sums:
            keys = sorted(sums)
            local = torch.tensor([sums[k] for k in keys], device=accelerator.device)  # (K, 2)
            totals = accelerator.reduce(local, "sum").tolist()  # (K, 2): token sum, tokens
            out.update({k: s / n if n > 0 else 0.0 for k, (s, n) in zip(keys, totals, strict=True)})
            sums.clear()
        return out


def log_completion_table(rows: list[dict], report_to: list[str], step: int) -> None:
    """Print sample completions with their rewards, and send them to wandb as a table."""
    lines = [f"completions at step {step}:"] + [
        f"  [{r['reward']:+.2f}] {r['prompt'][-60:]!r} -> {r['completion'][:120]!r}" for r in rows
    ]
    print("\n".join(lines))
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
            wandb.log({"completions": table}, commit=False)
