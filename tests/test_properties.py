"""Properties of the pure maths over many random inputs (hypothesis)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from loss_settings import grpo_loss_with

from grpo_hf.algorithm.advantages import group_advantages, group_std_is_zero
from grpo_hf.algorithm.loss import kl_estimate
from grpo_hf.algorithm.policy_terms import clipped_surrogate
from grpo_hf.config.grpo_config import LOSS_TYPES

SETTINGS = settings(max_examples=60, deadline=None)
REWARD = st.floats(-1e3, 1e3, width=32)


@st.composite
def grouped_rewards(draw) -> tuple[torch.Tensor, int]:
    """Rewards for 1-4 groups of G = 2-8, some groups constant on purpose."""
    G = draw(st.integers(2, 8))
    groups = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            groups.append([draw(REWARD)] * G)
        else:
            groups.append(draw(st.lists(REWARD, min_size=G, max_size=G)))
    return torch.tensor(groups, dtype=torch.float32).view(-1), G  # (groups * G,)


@SETTINGS
@given(grouped_rewards(), st.sampled_from(["group", "batch", "none"]))
def test_advantages_finite_and_zero_for_constant_groups(rewards_and_g, scale):
    rewards, G = rewards_and_g
    advantages = group_advantages(rewards, G, scale)  # (N,)
    assert advantages.shape == rewards.shape
    assert torch.isfinite(advantages).all()
    constant = group_std_is_zero(rewards, G)  # (groups,)
    assert (advantages.view(-1, G)[constant] == 0.0).all()


@st.composite
def loss_inputs(draw) -> dict:
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    logp = hnp.arrays(np.float32, (B, T), elements=st.floats(-20, 0, width=32))
    return {
        "logps": torch.from_numpy(draw(logp)),
        "old_logps": torch.from_numpy(draw(logp)),
        "ref_logps": torch.from_numpy(draw(logp)),
        "advantages": torch.from_numpy(
            draw(hnp.arrays(np.float32, (B,), elements=st.floats(-10, 10, width=32)))
        ),
        "completion_mask": torch.from_numpy(
            draw(hnp.arrays(np.float32, (B, T), elements=st.sampled_from([0.0, 1.0])))
        ),
        "entropy": torch.from_numpy(
            draw(hnp.arrays(np.float32, (B, T), elements=st.floats(0, 12, width=32)))
        ),
    }


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@SETTINGS
@given(
    inputs=loss_inputs(),
    level=st.sampled_from(["token", "sequence"]),
    estimator=st.sampled_from(["k1", "k2", "k3"]),
    beta=st.sampled_from([0.0, 0.04]),
    delta=st.sampled_from([None, 4.0]),
)
def test_grpo_loss_is_finite(loss_type, inputs, level, estimator, beta, delta):
    logps = inputs.pop("logps").requires_grad_()
    loss, metrics = grpo_loss_with(
        logps,
        **inputs,
        loss_type=loss_type,
        importance_sampling_level=level,
        kl_estimator=estimator,
        beta=beta,
        delta=delta,
        epsilon_high=0.28,
        entropy_coef=0.01,
    )
    assert torch.isfinite(loss)
    extremes = {"clip_ratio/low_min", "clip_ratio/high_max"}  # +-inf over no sequence: not recorded
    assert all(torch.isfinite(value) for name, value in metrics.items() if name not in extremes)
    empty = not inputs["completion_mask"].any()
    assert all(torch.isfinite(metrics[name]) != empty for name in extremes & metrics.keys())
    (grad,) = torch.autograd.grad(loss, logps)
    assert torch.isfinite(grad).all()


@SETTINGS
@given(
    log_ratio=hnp.arrays(np.float32, (3, 4), elements=st.floats(-5, 5, width=32)),
    advantages=hnp.arrays(np.float32, (3,), elements=st.floats(-10, 10, width=32)),
    epsilon=st.floats(0.01, 0.5),
    extra_high=st.floats(0.0, 0.3),
)
def test_clipped_objective_is_pessimistic(log_ratio, advantages, epsilon, extra_high):
    log_ratio, advantages = torch.from_numpy(log_ratio), torch.from_numpy(advantages)  # (3, 4), (3,)
    epsilon_high = epsilon + extra_high
    surrogate = clipped_surrogate(log_ratio, advantages, epsilon, epsilon_high)  # (3, 4)
    ratio = torch.exp(log_ratio)  # (3, 4)
    adv = advantages.unsqueeze(1)  # (3, 1)
    # Never above the unclipped objective r * A.
    assert (surrogate <= ratio * adv).all()
    # A > 0 only ever meets the upper clip, A < 0 only the lower one.
    positive = (adv > 0).expand_as(ratio)  # (3, 4)
    negative = (adv < 0).expand_as(ratio)  # (3, 4)
    upper = torch.clamp(ratio, max=1 + epsilon_high) * adv  # (3, 4)
    lower = torch.clamp(ratio, min=1 - epsilon) * adv  # (3, 4)
    torch.testing.assert_close(surrogate[positive], upper[positive])
    torch.testing.assert_close(surrogate[negative], lower[negative])


@SETTINGS
@given(hnp.arrays(np.float32, (8,), elements=st.floats(-20, 0, width=32)), st.floats(-20, 0, width=32))
def test_k3_is_never_negative(logps, ref):
    logps = torch.from_numpy(logps)  # (8,)
    assert (kl_estimate(logps, torch.full_like(logps, ref), "k3") >= 0).all()
