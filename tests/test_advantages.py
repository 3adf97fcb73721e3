"""Group advantages and reward aggregation, on numbers checkable by hand."""

import math

import pytest
import torch

from grpo_hf.advantages import EPS, combine_rewards, group_advantages, group_std_is_zero

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


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_groups_of_one_get_advantage_zero_not_nan(scale_rewards):
    # num_generations_eval=1: each reward is its own group's mean, r - mean = 0; the std of one value
    # counts as 0 (torch.std would give NaN, and 0 / NaN is NaN), so A = 0 / (0 + eps) = 0.
    advantages = group_advantages(torch.tensor([1.0, 3.0]), 1, scale_rewards)
    assert advantages.tolist() == [0.0, 0.0]
    assert group_advantages(torch.tensor([2.0]), 1, scale_rewards).tolist() == [
        0.0
    ]  # batch std of one value too
