"""Round metrics and their reduction over a logging interval, with hand-computed values."""

import math
from types import SimpleNamespace

import pytest
import torch
from accelerate import PartialState

from grpo_hf.training.metrics import (
    IntervalMetrics,
    completion_metrics,
    reduce_logged_metrics,
    reward_metrics,
)

NAN = math.nan


def one_process():
    """An accelerator's reduction interface on one process: reduce and gather are the identity."""
    PartialState()  # gather_object reads the (single-process) state
    return SimpleNamespace(device=torch.device("cpu"), reduce=lambda t, _: t, gather=lambda t: t)


def test_reward_metrics_by_hand():
    # Two groups of G = 4: rewards (1, 0, 1, 1) and (0, 0, 0, 0).
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    per_func = torch.stack([rewards, torch.tensor([0.5, NAN, 1.5, NAN, 0, 0, 0, 0])], dim=1)
    advantages = torch.tensor([0.5, -1.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    values = reward_metrics(rewards, rewards, per_func, ["accuracy", "format"], advantages, 4)
    assert values["reward"] == 0.375  # 3 / 8
    # TRL's reward_std, over the whole batch: mean 0.375, squared deviations 3 * 0.625^2 + 5 * 0.375^2
    # = 1.875, unbiased sqrt(1.875 / 7) = 0.5175492.
    assert values["reward_std"] == pytest.approx(math.sqrt(1.875 / 7), rel=1e-6)
    # Ours, the mean of the groups' stds: group 1 sqrt((3 * 0.25^2 + 0.75^2) / 3) = 0.5; group 2: 0.
    assert values["reward_std/group_mean"] == 0.25
    assert values["frac_reward_zero_std"] == 0.5
    assert values["advantage/abs_mean"] == 0.375  # 3 / 8
    assert (values["advantage/min"], values["advantage/max"]) == (-1.5, 0.5)
    assert values["reward/accuracy"] == values["rewards/accuracy/mean"] == 0.375
    assert values["rewards/accuracy/std"] == values["reward_std"]
    # format: NaN (does not apply) left out: 0.5, 1.5, 0, 0, 0, 0 -> mean 2 / 6; squared deviations
    # from 1/3: (1/6)^2 + (7/6)^2 + 4 (1/3)^2 = 1/36 + 49/36 + 16/36 = 66/36, unbiased / 5.
    assert values["reward/format"] == values["rewards/format/mean"] == pytest.approx(2.0 / 6)
    assert values["rewards/format/std"] == pytest.approx(math.sqrt(66 / 36 / 5), rel=1e-6)


def test_unscorable_completions_are_left_out_of_the_reward_metrics():
    rewards = torch.tensor([1.0, NAN, 0.0, 2.0, 3.0, 3.0, NAN, NAN])  # (8,) G = 4
    values = reward_metrics(rewards, rewards, rewards.unsqueeze(1), ["r"], torch.zeros(8), 4)
    assert values["reward"] == pytest.approx(9 / 5)  # 1 + 0 + 2 + 3 + 3 over 5
    # 1, 0, 2, 3, 3: squared deviations from 1.8: 0.64 + 3.24 + 0.04 + 1.44 + 1.44 = 6.8, / 4 = 1.7.
    assert values["reward_std"] == pytest.approx(math.sqrt(1.7), rel=1e-6)
    assert values["reward_std/group_mean"] == pytest.approx(0.5)  # std 1 (1, 0, 2) and 0 (3, 3)
    assert values["frac_reward_zero_std"] == 0.5  # group 2's scored rows are equal


def test_frac_reward_zero_std_counts_groups_whose_aggregate_has_no_spread():
    # The weighted sums differ in group 1 but its normalize_then_sum aggregate does not: it teaches nothing.
    rewards = torch.tensor([1.0, 2.0, 0.0, 1.0])  # (4,) G = 2
    aggregated = torch.tensor([0.0, 0.0, -0.7, 0.7])  # (4,)
    values = reward_metrics(rewards, aggregated, rewards.unsqueeze(1), ["r"], torch.zeros(4), 2)
    assert values["frac_reward_zero_std"] == 0.5


def test_completion_metrics_by_hand():
    lengths = torch.tensor([3.0, 5.0, 7.0, 9.0, 2.0, 2.0, 2.0, 10.0])
    truncated = torch.tensor([False, False, False, True, False, False, False, True])
    values = completion_metrics(lengths, truncated)
    assert values["completions/mean_length"] == 5.0  # 40 / 8
    assert (values["completions/min_length"], values["completions/max_length"]) == (2.0, 10.0)
    assert values["completions/clipped_ratio"] == 0.25
    # Ended with EOS: 3, 5, 7, 2, 2, 2 -> mean 21 / 6.
    assert values["completions/mean_terminated_length"] == 3.5
    assert values["completions/min_terminated_length"] == 2.0
    assert values["completions/max_terminated_length"] == 7.0
    none_ended = completion_metrics(lengths[:2], torch.tensor([True, True]))
    assert none_ended["completions/mean_terminated_length"] == 0.0  # as TRL: 0 when none ended


def test_interval_reduction_leaves_nan_out_and_keeps_the_latest_total():
    metrics = IntervalMetrics()
    metrics.record(
        "train", {"reward": 1.0, "rewards/x/mean": NAN, "num_tokens": 100, "nonfinite_steps_skipped": 1}
    )
    metrics.record(
        "train", {"reward": NAN, "rewards/x/mean": NAN, "num_tokens": 250, "nonfinite_steps_skipped": 1}
    )
    metrics.record("train", {"reward": 3.0})
    metrics.record_token_means("train", {"clip_ratio/low": 0.5, "clip_ratio/region": 0.5}, tokens=2)
    metrics.record_token_means("train", {"clip_ratio/low": 0.0, "clip_ratio/region": 0.25}, tokens=6)
    out = metrics.reduce("train", one_process())
    assert out["reward"] == 2.0  # (1 + 3) / 2, the NaN record left out
    assert "rewards/x/mean" not in out  # no value at all: not logged (TRL logs None)
    assert out["num_tokens"] == 250  # the running total's last value, not a mean
    assert out["nonfinite_steps_skipped"] == 2
    # Token means: (0.5 * 2 + 0 * 6) / 8 = 0.125; (0.5 * 2 + 0.25 * 6) / 8 = 0.3125 (TRL's names for
    # the clip ratios are recorded beside ours by the loss: policy_terms' tests).
    assert out["clip_ratio/low"] == 0.125
    assert out["clip_ratio/region"] == 0.3125
    assert metrics.reduce("train", one_process()) == {}  # cleared


def test_logged_metrics_are_the_mean_of_every_value_of_the_round():
    out = reduce_logged_metrics({"accuracy": [0.5, 1.0, 0.0], "calls": [4.0]}, one_process())
    assert out == {"accuracy": 0.5, "calls": 4.0}
    assert reduce_logged_metrics({}, one_process()) == {}
