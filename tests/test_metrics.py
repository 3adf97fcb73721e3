"""Round metrics with hand-computed values."""

import math

import pytest
import torch

from grpo_hf.metrics import round_metrics


def test_round_metrics_by_hand():
    # Two groups of G = 4: rewards (1, 0, 1, 1) and (0, 0, 0, 0).
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    per_func = torch.stack([rewards, torch.tensor([0.5, math.nan, 1.5, math.nan, 0, 0, 0, 0])], dim=1)
    advantages = torch.tensor([0.5, -1.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    lengths = torch.tensor([3.0, 5.0, 7.0, 9.0, 2.0, 2.0, 2.0, 10.0])
    truncated = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    values = round_metrics(rewards, per_func, ["accuracy", "format"], advantages, lengths, truncated, 4)
    assert values["reward"] == 0.375  # 3 / 8
    # group 1: mean 0.75, unbiased std sqrt((3 * 0.25^2 + 0.75^2) / 3) = 0.5; group 2: 0
    assert values["reward_std"] == 0.25
    assert values["frac_reward_zero_std"] == 0.5
    assert values["advantage/abs_mean"] == 0.375  # 3 / 8
    assert (values["advantage/min"], values["advantage/max"]) == (-1.5, 0.5)
    assert values["completions/mean_length"] == 5.0  # 40 / 8
    assert (values["completions/min_length"], values["completions/max_length"]) == (2.0, 10.0)
    assert values["completions/clipped_ratio"] == 0.25
    assert values["reward/accuracy"] == 0.375
    assert values["reward/format"] == pytest.approx(2.0 / 6)  # NaN (does not apply) left out of the mean
