"""What a generation round logs: its metrics from tensors gathered over every process, and the
completion table (printed, and sent to wandb when it is a reporter)."""

import torch

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
