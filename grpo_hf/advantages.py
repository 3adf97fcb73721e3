"""Group-relative advantages and reward aggregation (DeepSeekMath, arXiv 2402.03300).

`A_i = (r_i - mean_G r) / (std_G r + eps)`, with the scale chosen by `scale_rewards`:
`group` divides by the group's std (the paper; seed 000's "local"), `batch` by the std of all
rewards in the generation batch (seed 000's "global"), `none` not at all (Dr. GRPO, arXiv
2503.20783, which argues the std term biases the update towards too easy and too hard prompts).
Standard deviations are unbiased (n - 1), as `torch.std`. A group whose rewards are all equal gets
advantage exactly 0: its numerator is exactly 0, and eps keeps the division finite.
"""

import torch

EPS = 1e-4


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> torch.Tensor:
    """(N,) advantages for N = groups x num_generations rewards laid out group by group."""
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by num_generations={num_generations}, "
            f"got shape {tuple(rewards.shape)}."
        )
    grouped = rewards.view(-1, num_generations)  # (groups, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # (groups, G)
    # A float mean of equal values can miss them (six 0.3s: off by 3e-8, which / eps is 3e-4):
    # zero constant groups explicitly so they give exactly 0.
    centred = centred.masked_fill(group_std_is_zero(rewards, num_generations).unsqueeze(1), 0.0)
    # A std of one value is 0 here, not NaN (a group of one: num_generations_eval=1 in evaluation).
    if scale_rewards == "group":
        scale = (grouped.std(dim=1, keepdim=True) if num_generations > 1 else 0.0) + EPS  # (groups, 1)
    elif scale_rewards == "batch":
        scale = (rewards.std() if rewards.numel() > 1 else 0.0) + EPS  # ()
    elif scale_rewards == "none":
        scale = torch.ones((), dtype=rewards.dtype, device=rewards.device)
    else:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of ('group', 'batch', 'none').")
    return (centred / scale).view(-1)  # (N,)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, F) rewards, NaN where a function does not apply, -> (N,) weighted sum over the functions.

    A NaN counts as 0 in the sum; a row that is NaN for every function is the caller's error.
    """
    return (rewards_per_func.nan_to_num(nan=0.0) * weights.unsqueeze(0)).sum(dim=1)  # (N,)


def group_std_is_zero(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(groups,) bool: the group's rewards are all equal, so it teaches nothing."""
    grouped = rewards.view(-1, num_generations)  # (groups, G)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) == 0
