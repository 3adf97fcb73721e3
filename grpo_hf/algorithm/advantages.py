"""Group-relative advantages and reward aggregation (DeepSeekMath, arXiv 2402.03300).

`A_i = (r_i - mean_G r) / (std_G r + eps)`, with the scale chosen by `scale_rewards`:
`group` divides by the group's std (the paper; seed 000's "local"), `batch` by the std of all
rewards in the generation batch (seed 000's "global"), `none` not at all (Dr. GRPO, arXiv
2503.20783, which argues the std term biases the update towards too easy and too hard prompts).
Standard deviations are unbiased (n - 1), as `torch.std`. A group whose rewards are all equal gets
advantage exactly 0: its numerator is exactly 0, and eps keeps the division finite.

Several reward functions are aggregated by `multi_objective_aggregation`:
- `sum_then_normalize` (default): the weighted sum of the raw rewards, then the group advantage above.
- `normalize_then_sum` (GDPO, arXiv 2601.05242): each function's rewards are normalised within
  their group, `(r_k - mean_G r_k) / (std_G r_k + eps)`, the weighted sum of those is centred and
  scaled by the mean and std of the whole batch; `scale_rewards` does not apply (as in TRL).

NaN means "does not apply" (a reward function returned None). A function's NaN counts as 0 in a
weighted sum; a completion with NaN from every function is unscorable: it is left out of its
group's (and the batch's) mean and std and gets advantage 0, as in TRL.
"""

import torch

EPS = 1e-4
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def nan_std(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased (n - 1) standard deviation over the non-NaN values; NaN where fewer than two."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    mean = values.nanmean(dim=dim, keepdim=True)
    count = (~values.isnan()).sum(dim=dim, keepdim=keepdim)
    squares = ((values - mean) ** 2).nansum(dim=dim, keepdim=keepdim)
    return torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.nan).sqrt()


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> torch.Tensor:
    """(N,) advantages for N = groups x num_generations rewards laid out group by group.

    NaN rewards (unscorable completions) are left out of the means and stds and get advantage 0.
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by num_generations={num_generations}, "
            f"got shape {tuple(rewards.shape)}."
        )
    grouped = rewards.view(-1, num_generations)  # (groups, G)
    centred = grouped - grouped.nanmean(dim=1, keepdim=True)  # (groups, G)
    # A float mean of equal values can miss them (six 0.3s: off by 3e-8, which / eps is 3e-4):
    # zero constant groups explicitly so they give exactly 0.
    centred = centred.masked_fill(group_std_is_zero(rewards, num_generations).unsqueeze(1), 0.0)
    # A std of one value is 0 here, not NaN (a group of one: num_generations_eval=1 in evaluation).
    if scale_rewards == "group":
        scale = nan_std(grouped, dim=1, keepdim=True).nan_to_num(nan=0.0) + EPS  # (groups, 1)
    elif scale_rewards == "batch":
        scale = nan_std(rewards).nan_to_num(nan=0.0) + EPS  # ()
    elif scale_rewards == "none":
        scale = torch.ones((), dtype=rewards.dtype, device=rewards.device)
    else:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of ('group', 'batch', 'none').")
    return (centred / scale).nan_to_num(nan=0.0).view(-1)  # (N,)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, F) rewards, NaN where a function does not apply, -> (N,) weighted sum over the functions.

    A NaN counts as 0 in the sum; a row that is NaN for every function stays NaN (unscorable).
    """
    summed = (rewards_per_func.nan_to_num(nan=0.0) * weights.unsqueeze(0)).sum(dim=1)  # (N,)
    return summed.masked_fill(rewards_per_func.isnan().all(dim=1), torch.nan)  # (N,)


def normalize_per_group(rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N, F) -> (N, F): each function's rewards centred and scaled within their group (GDPO).

    `(r - mean_G r) / (std_G r + eps)` over the group's non-NaN values; a function constant on its
    group's scored completions gives exactly 0 there; NaN stays NaN.
    """
    n, funcs = rewards_per_func.shape
    columns = rewards_per_func.T.reshape(funcs * n)  # (F * N,) function by function, group by group
    normalized = group_advantages(columns, num_generations, "group")  # (F * N,)
    normalized = normalized.masked_fill(columns.isnan(), torch.nan)  # keep "does not apply"
    return normalized.view(funcs, n).T  # (N, F)


def aggregate_rewards(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, aggregation: str
) -> torch.Tensor:
    """(N, F) -> (N,): the reward the advantages are computed from (NaN for unscorable rows).

    `sum_then_normalize`: the weighted sum of the raw rewards; `normalize_then_sum`: the weighted
    sum of the per-group normalised rewards. A group whose aggregate has no spread teaches nothing
    (dynamic sampling drops it; `frac_reward_zero_std` counts it).
    """
    if aggregation == "sum_then_normalize":
        return combine_rewards(rewards_per_func, weights)  # (N,)
    if aggregation == "normalize_then_sum":
        return combine_rewards(normalize_per_group(rewards_per_func, num_generations), weights)  # (N,)
    raise ValueError(f"multi_objective_aggregation={aggregation!r} is not one of {AGGREGATIONS}.")


def compute_advantages(
    aggregated: torch.Tensor, num_generations: int, scale_rewards: str, aggregation: str
) -> torch.Tensor:
    """(N,) advantages from `aggregate_rewards`' output (NaN rows get 0).

    `sum_then_normalize`: `group_advantages` with `scale_rewards`; `normalize_then_sum`: centred and
    scaled over the whole batch, `(a - mean a) / (std a + eps)` (GDPO's batch-level normalisation).
    """
    if aggregation == "sum_then_normalize":
        return group_advantages(aggregated, num_generations, scale_rewards)  # (N,)
    if aggregation != "normalize_then_sum":
        raise ValueError(f"multi_objective_aggregation={aggregation!r} is not one of {AGGREGATIONS}.")
    # One group holding the whole batch: the batch mean and std, constant batch exactly 0.
    return group_advantages(aggregated, aggregated.numel(), "group")  # (N,)


def batch_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    aggregation: str,
    scale_rewards: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every process's (N, F) rewards -> their aggregate (N,) and advantages (N,), as
    `multi_objective_aggregation` and `scale_rewards` say."""
    weights = weights.to(rewards_per_func.device)
    aggregated = aggregate_rewards(rewards_per_func, weights, num_generations, aggregation)  # (N,)
    return aggregated, compute_advantages(aggregated, num_generations, scale_rewards, aggregation)


def group_std_is_zero(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(groups,) bool: the group's rewards (NaN left out) are all equal, so it teaches nothing."""
    grouped = rewards.view(-1, num_generations)  # (groups, G)
    missing = grouped.isnan()  # (groups, G)
    highest = grouped.masked_fill(missing, -torch.inf).max(dim=1).values  # (groups,)
    lowest = grouped.masked_fill(missing, torch.inf).min(dim=1).values  # (groups,)
    return (highest - lowest) <= 0  # an all-NaN group: -inf - inf <= 0
