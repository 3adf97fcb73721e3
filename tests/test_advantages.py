"""Group advantages and reward aggregation, on numbers checkable by hand."""

import math

import pytest
import torch

from grpo_hf.algorithm.advantages import (
    EPS,
    aggregate_rewards,
    combine_rewards,
    compute_advantages,
    group_advantages,
    group_std_is_zero,
    nan_std,
    normalize_per_group,
)

NAN = math.nan

# The seed notebook's four groups of G = 4: graded, all right, all wrong, mixed.
SEED_REWARDS = torch.tensor(
    [1.0, 0.8, 0.6, 0.4, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.5]
)  # (16,)


def test_eps_is_the_documented_one():
    assert EPS == 1e-4


def test_group_scale_on_seed_groups():
    # Group 1: mean 0.7, deviations (.3, .1, -.1, -.3), sum of squares 0.2,
    #   unbiased std = sqrt(0.2 / 3) = sqrt(1/15) = 0.2581989; A = dev / (0.2581989 + 1e-4).
    s1 = math.sqrt(0.2 / 3) + 1e-4  # 0.2582989
    # Group 4: mean 0.5, deviations (.5, -.5, 0, 0), sum of squares 0.5,
    #   unbiased std = sqrt(0.5 / 3) = 0.4082483; A = dev / (0.4082483 + 1e-4).
    s4 = math.sqrt(0.5 / 3) + 1e-4  # 0.4083483
    expected = torch.tensor(
        [0.3 / s1, 0.1 / s1, -0.1 / s1, -0.3 / s1]  # 1.16145, 0.38715, -0.38715, -1.16145
        + [0.0] * 4  # all right: no signal
        + [0.0] * 4  # all wrong: no signal
        + [0.5 / s4, -0.5 / s4, 0.0, 0.0]  # 1.22444, -1.22444, 0, 0
    )  # (16,)
    assert expected[0].item() == pytest.approx(1.1614452, rel=1e-6)
    assert expected[12].item() == pytest.approx(1.2244449, rel=1e-6)
    advantages = group_advantages(SEED_REWARDS, num_generations=4, scale_rewards="group")  # (16,)
    assert advantages.shape == (16,)
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-6)


def test_batch_scale_on_seed_groups():
    # Centred by each group's mean, scaled by the std of all 16 rewards:
    #   batch mean = 8.8 / 16 = 0.55; sum of squared deviations = 2.82; unbiased std = sqrt(2.82 / 15)
    #   = 0.4335897, plus eps = 0.4336897.
    s = math.sqrt(2.82 / 15) + 1e-4
    expected = torch.tensor(
        [0.3 / s, 0.1 / s, -0.1 / s, -0.3 / s]  # 0.69174, 0.23058, ...
        + [0.0] * 8
        + [0.5 / s, -0.5 / s, 0.0, 0.0]  # 1.15290, -1.15290, 0, 0
    )  # (16,)
    assert expected[0].item() == pytest.approx(0.6917389, rel=1e-6)
    advantages = group_advantages(SEED_REWARDS, 4, "batch")  # (16,)
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-6)


def test_none_scale_only_centres():
    # Dr. GRPO: r - group mean, no division.
    expected = torch.tensor([0.3, 0.1, -0.1, -0.3] + [0.0] * 8 + [0.5, -0.5, 0.0, 0.0])  # (16,)
    advantages = group_advantages(SEED_REWARDS, 4, "none")  # (16,)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.3, 0.1, -3.3, 1e6 + 0.1])
@pytest.mark.parametrize("G", [2, 3, 4, 6, 7, 8])
def test_all_equal_group_is_exactly_zero(scale, value, G):
    # Six 0.3s have a float32 mean 3e-8 away from 0.3: the zero must not come from the arithmetic.
    rewards = torch.cat([torch.full((G,), value), torch.arange(G, dtype=torch.float32)])  # (2G,)
    advantages = group_advantages(rewards, G, scale)  # (2G,)
    assert not advantages.isnan().any()
    assert (advantages[:G] == 0.0).all(), advantages[:G]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_whole_batch_constant_is_zero_not_nan(scale):
    advantages = group_advantages(torch.full((8,), 0.7), 4, scale)  # (8,) std 0: 0 / eps
    assert torch.equal(advantages, torch.zeros(8))


def test_wrong_shapes_raise():
    with pytest.raises(ValueError, match="num_generations=4"):
        group_advantages(torch.zeros(6), 4)  # 6 is not a multiple of 4
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)  # (2, 4) is not 1-D


def test_unknown_scale_rewards_raises():
    with pytest.raises(ValueError, match="scale_rewards='local'"):
        group_advantages(SEED_REWARDS, 4, "local")


def test_combine_rewards_nan_counts_as_zero_and_weights_apply():
    nan = float("nan")  # a reward function returned None: "does not apply"
    rewards_per_func = torch.tensor(
        [
            [1.0, 2.0],  # 1 * 1 + 0.5 * 2 = 2
            [1.0, nan],  # 1 * 1 + 0 = 1
            [nan, 4.0],  # 0 + 0.5 * 4 = 2
            [0.0, -2.0],  # 0 + 0.5 * -2 = -1
        ]
    )  # (N=4, F=2)
    weights = torch.tensor([1.0, 0.5])  # (F,)
    combined = combine_rewards(rewards_per_func, weights)  # (4,)
    assert torch.equal(combined, torch.tensor([2.0, 1.0, 2.0, -1.0]))


def test_combine_rewards_from_none_entries():
    per_func = [[0.5, None], [None, 1.0], [1.0, 1.0]]  # as reward functions return them
    rewards = torch.tensor([[math.nan if v is None else v for v in row] for row in per_func])  # (3, 2)
    combined = combine_rewards(rewards, torch.tensor([2.0, 3.0]))  # (3,)
    assert torch.equal(combined, torch.tensor([1.0, 3.0, 5.0]))  # 2*.5; 3*1; 2*1 + 3*1
    assert not combined.isnan().any()


def test_group_std_is_zero_on_seed_groups():
    flags = group_std_is_zero(SEED_REWARDS, 4)  # (4,)
    assert flags.tolist() == [False, True, True, False]
    assert flags.dtype == torch.bool


# ---- Unscorable completions (None from every reward function) -----------------------------------


def test_combine_rewards_keeps_a_row_without_any_reward_nan():
    rewards = torch.tensor([[NAN, NAN], [1.0, NAN]])  # (2, 2)
    combined = combine_rewards(rewards, torch.tensor([2.0, 3.0]))  # (2,)
    assert combined[0].isnan() and combined[1] == 2.0


def test_nan_std_leaves_nan_out_and_needs_two_values():
    # 1, 0, 2: mean 1, squared deviations 0 + 1 + 1 = 2, unbiased 2 / 2 = 1.
    assert nan_std(torch.tensor([1.0, NAN, 0.0, 2.0])).item() == 1.0
    rows = nan_std(torch.tensor([[3.0, NAN], [NAN, NAN]]), dim=1)  # (2,) one value, none
    assert rows.isnan().all()


def test_unscorable_rows_are_left_out_of_the_group_and_get_zero():
    rewards = torch.tensor([1.0, NAN, 0.0, 2.0, NAN, NAN, NAN, NAN, 5.0, NAN, 5.0, 5.0])  # (12,) G = 4
    # Group 1 scored 1, 0, 2: mean 1, unbiased std 1 -> (0, -, -1, 1) / (1 + 1e-4).
    # Group 2 has no score, group 3 is constant among its scored rows: all 0.
    expected = torch.tensor([0.0, 0.0, -1 / 1.0001, 1 / 1.0001] + [0.0] * 8)  # (12,)
    torch.testing.assert_close(group_advantages(rewards, 4, "group"), expected, rtol=1e-6, atol=1e-7)
    # none: only centred on the scored rows' mean.
    expected_none = torch.tensor([0.0, 0.0, -1.0, 1.0] + [0.0] * 8)  # (12,)
    assert torch.equal(group_advantages(rewards, 4, "none"), expected_none)
    # batch: the std of the 6 scored rewards 1, 0, 2, 5, 5, 5: mean 3, squares 4 + 9 + 1 + 3 * 4 = 26,
    # unbiased sqrt(26 / 5) = 2.2803509.
    s = math.sqrt(26 / 5) + 1e-4
    expected_batch = torch.tensor([0.0, 0.0, -1 / s, 1 / s] + [0.0] * 8)  # (12,)
    torch.testing.assert_close(group_advantages(rewards, 4, "batch"), expected_batch, rtol=1e-6, atol=1e-7)
    assert group_std_is_zero(rewards, 4).tolist() == [False, True, True]


# ---- multi_objective_aggregation ----------------------------------------------------------------

# Two groups of G = 2, two reward functions, weights (1, 0.5). Group 1: f1 = (1, 0), f2 = (0, 2);
# group 2: f1 = (1, 1), f2 = (3, None).
PER_FUNC = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 3.0], [1.0, NAN]])  # (4, 2)
WEIGHTS = torch.tensor([1.0, 0.5])  # (2,)


def test_sum_then_normalize_sums_the_raw_rewards_first():
    # Weighted sums: group 1 (1 + 0, 0 + 1) = (1, 1): no spread, no signal;
    # group 2 (1 + 1.5, 1 + 0) = (2.5, 1): deviations +-0.75, unbiased std 1.5 / sqrt 2 = 1.0606602.
    aggregated = aggregate_rewards(PER_FUNC, WEIGHTS, 2, "sum_then_normalize")  # (4,)
    assert aggregated.tolist() == [1.0, 1.0, 2.5, 1.0]
    a = 0.75 / (1.5 / math.sqrt(2) + 1e-4)  # 0.7070401
    advantages = compute_advantages(aggregated, 2, "group", "sum_then_normalize")  # (4,)
    torch.testing.assert_close(advantages, torch.tensor([0.0, 0.0, a, -a]), rtol=1e-6, atol=1e-7)


def test_normalize_then_sum_normalizes_each_reward_in_its_group_then_the_sum_over_the_batch():
    # Group 1, f1 (1, 0): deviations +-0.5, std 1 / sqrt 2 -> +-0.5 / (0.7071068 + 1e-4) = +-0.7070068;
    #          f2 (0, 2): deviations -+1, std sqrt 2 -> -+1 / (1.4142136 + 1e-4) = -+0.7070568.
    # Group 2, f1 constant -> 0, 0; f2 a single score -> 0, and None stays None.
    n1 = 0.5 / (1 / math.sqrt(2) + 1e-4)
    n2 = 1 / (math.sqrt(2) + 1e-4)
    normalized = normalize_per_group(PER_FUNC, 2)  # (4, 2)
    expected = torch.tensor([[n1, -n2], [-n1, n2], [0.0, 0.0], [0.0, NAN]])  # (4, 2)
    torch.testing.assert_close(normalized, expected, rtol=1e-6, atol=1e-7, equal_nan=True)
    # Weighted sums: a = n1 - 0.5 * n2 = 0.3534784, then -a, 0, 0 (None counts 0).
    a = n1 - 0.5 * n2
    aggregated = aggregate_rewards(PER_FUNC, WEIGHTS, 2, "normalize_then_sum")  # (4,)
    torch.testing.assert_close(aggregated, torch.tensor([a, -a, 0.0, 0.0]), rtol=1e-6, atol=1e-7)
    # Batch level: mean 0, unbiased std sqrt(2 a^2 / 3) = 0.2886139 -> a / (0.2886139 + 1e-4) = 1.2243207.
    # Group 1 teaches here while the summed raw rewards gave it nothing (test above).
    b = a / (a * math.sqrt(2 / 3) + 1e-4)
    assert b == pytest.approx(1.2243207, rel=1e-6)
    for scale in ("group", "batch", "none"):  # scale_rewards does not apply (as in TRL)
        advantages = compute_advantages(aggregated, 2, scale, "normalize_then_sum")  # (4,)
        torch.testing.assert_close(advantages, torch.tensor([b, -b, 0.0, 0.0]), rtol=1e-5, atol=1e-6)


def test_normalize_then_sum_leaves_unscorable_rows_out_and_gives_them_zero():
    per_func = torch.tensor(
        [[1.0, NAN], [NAN, NAN], [0.0, NAN], [2.0, NAN]]
    )  # (4, 2) G = 4, row 1 unscorable
    aggregated = aggregate_rewards(per_func, WEIGHTS, 4, "normalize_then_sum")  # (4,)
    # f1 over rows 0, 2, 3: 1, 0, 2, mean 1, std 1 -> 0, -1, 1 (/ 1.0001); f2 does not apply (0).
    assert aggregated[1].isnan()
    torch.testing.assert_close(aggregated[[0, 2, 3]], torch.tensor([0.0, -1, 1]) / 1.0001)
    # Batch: the same three values, mean 0, std 1 / 1.0001 -> +-1 / (1 / 1.0001 + 1e-4).
    c = (1 / 1.0001) / (1 / 1.0001 + 1e-4)
    advantages = compute_advantages(aggregated, 4, "group", "normalize_then_sum")  # (4,)
    torch.testing.assert_close(advantages, torch.tensor([0.0, 0.0, -c, c]), rtol=1e-6, atol=1e-7)


def test_a_constant_batch_gets_exactly_zero_under_normalize_then_sum():
    per_func = torch.tensor([[0.3, 1.0]] * 6)  # (6, 2): every reward constant in its group of 3
    aggregated = aggregate_rewards(per_func, WEIGHTS, 3, "normalize_then_sum")  # (6,)
    assert torch.equal(aggregated, torch.zeros(6))
    assert torch.equal(compute_advantages(aggregated, 3, "group", "normalize_then_sum"), torch.zeros(6))


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="multi_objective_aggregation='mean'"):
        aggregate_rewards(PER_FUNC, WEIGHTS, 2, "mean")


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_groups_of_one_get_advantage_zero_not_nan(scale_rewards):
    # num_generations_eval=1: each reward is its own group's mean, r - mean = 0; the std of one value
    # counts as 0 (torch.std would give NaN, and 0 / NaN is NaN), so A = 0 / (0 + eps) = 0.
    advantages = group_advantages(torch.tensor([1.0, 3.0]), 1, scale_rewards)
    assert advantages.tolist() == [0.0, 0.0]
    assert group_advantages(torch.tensor([2.0]), 1, scale_rewards).tolist() == [
        0.0
    ]  # batch std of one value too
