"""The policy terms of cispo, sapo, luspo and vespo, and the warnings for loss settings that do not
fit, on one-token and two-token batches whose values are computed by hand in the comments."""

import logging
import math

import pytest
import torch
from loss_settings import grpo_loss_with

from grpo_hf.algorithm.policy_terms import get_gamma_weights
from grpo_hf.config.grpo_config import GRPOConfig

LOG_HALF = math.log(0.5)


def token(value: float) -> torch.Tensor:
    return torch.tensor([[value]])  # (B=1, T=1)


def one_token_loss(log_ratio: float, advantage: float, logp: float = LOG_HALF, **kwargs):
    """Loss, d loss / d logp and metrics of one token with log-prob `logp` and log(pi / pi_old) = log_ratio."""
    logps = token(logp).requires_grad_()
    loss, metrics = grpo_loss_with(
        logps, token(logp - log_ratio), None, torch.tensor([advantage]), token(1.0), **kwargs
    )
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.item(), grad.item(), metrics


# ---- CISPO -------------------------------------------------------------------------------------


def test_cispo_weight_below_the_cap_multiplies_minus_advantage_log_prob():
    # r = e = 2.71828 < epsilon_high 5: loss = -sg(r) A log pi = -2.71828 x 1 x log 0.5 = 1.88417;
    # the weight is detached, so d loss / d log pi = -r A = -2.71828 (PPO's clip would give 0 here)
    loss, grad, metrics = one_token_loss(1.0, 1.0, loss_type="cispo", epsilon_high=5.0)
    assert loss == pytest.approx(-math.e * LOG_HALF)
    assert grad == pytest.approx(-math.e)
    assert metrics["cispo_clip_ratio"].item() == 0.0


def test_cispo_caps_the_weight_at_epsilon_high_itself():
    # r = e capped at 2 (not 1 + 2): loss = -2 x 1 x log 0.5 = 1.38629, gradient -2: still a gradient
    loss, grad, metrics = one_token_loss(1.0, 1.0, loss_type="cispo", epsilon_high=2.0)
    assert loss == pytest.approx(-2 * LOG_HALF)
    assert grad == pytest.approx(-2.0)
    assert metrics["cispo_clip_ratio"].item() == 1.0  # r > epsilon_high with A > 0
    # A = -1: the same cap, gradient +2; TRL counts only A > 0 in cispo_clip_ratio
    loss, grad, metrics = one_token_loss(1.0, -1.0, loss_type="cispo", epsilon_high=2.0)
    assert loss == pytest.approx(2 * LOG_HALF)
    assert grad == pytest.approx(2.0)
    assert metrics["cispo_clip_ratio"].item() == 0.0
    assert "clip_ratio/low" not in metrics  # no PPO clip here


def test_cispo_with_the_sequence_ratio_caps_the_sequence_weight():
    """Two tokens with log-ratios 0.2 and 1.0: GSPO's ratio e^0.6 = 1.82212 capped at 1.5 for both;
    dapo's mean: -1.5 x 1 x (log 0.5 + log 0.25) / 2 = 1.5 x 1.5 log 2 = 1.55958."""
    logps = torch.log(torch.tensor([[0.5, 0.25]]))  # (1, 2)
    loss, _ = grpo_loss_with(
        logps, logps - torch.tensor([[0.2, 1.0]]), None, torch.tensor([1.0]), torch.ones(1, 2),
        loss_type="cispo", epsilon_high=1.5, importance_sampling_level="sequence",
    )  # fmt: skip
    assert loss.item() == pytest.approx(1.5 * 1.5 * math.log(2))


# ---- SAPO --------------------------------------------------------------------------------------


def test_sapo_soft_gate_for_a_positive_advantage():
    # r = e^0.5 = 1.64872, tau_pos = 1: loss = -(4 / 1) sigmoid(0.64872) x 1 = -4 x 0.656722 = -2.62689;
    # gradient -4 sigmoid (1 - sigmoid) r = -4 x 0.656722 x 0.343278 x 1.64872 = -1.48674: attenuated
    # from -r = -1.64872, never cut to 0 like a clip
    loss, grad, metrics = one_token_loss(0.5, 1.0, loss_type="sapo")
    assert loss == pytest.approx(-2.6268890)
    assert grad == pytest.approx(-1.4867386)
    assert metrics == {"policy_loss": pytest.approx(-2.6268890)}  # SAPO has no clip metric (as TRL)


def test_sapo_uses_the_negative_temperature_for_a_negative_advantage():
    # r = e^-0.5 = 0.606531, A = -1, tau_neg = 1.05: loss = (4 / 1.05) sigmoid(1.05 x -0.393469) = 1.51680;
    # gradient 4 sigmoid (1 - sigmoid) r = 0.581368
    loss, grad, _ = one_token_loss(-0.5, -1.0, loss_type="sapo")
    assert loss == pytest.approx(1.5167953)
    assert grad == pytest.approx(0.5813678)
    # tau_neg = 2: 2 sigmoid(2 x -0.393469) = 2 x 0.312870 = 0.625740: the temperature matters
    loss, _, _ = one_token_loss(-0.5, -1.0, loss_type="sapo", sapo_temperature_neg=2.0)
    assert loss == pytest.approx(2 / (1 + math.exp(2 * (1 - math.exp(-0.5)))))


def test_sapo_aggregates_like_grpo():
    """At r = 1, A = +1: per token -2; rows of 1 and 3 tokens: row means (-2, -2) -> -2, whatever the
    lengths; tau_pos 2 gives -1."""
    logps = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    for tau, value in ((1.0, -2.0), (2.0, -1.0)):
        loss, _ = grpo_loss_with(
            logps, None, None, torch.tensor([1.0, 1.0]), mask, loss_type="sapo", sapo_temperature_pos=tau
        )
        assert loss.item() == pytest.approx(value)


# ---- LUSPO -------------------------------------------------------------------------------------


def test_luspo_weighs_each_sequence_by_its_length():
    """GSPO's clipped sequence ratio, summed over each sequence then averaged: rows of 1 and 3 tokens
    with ratio 1 and A = (+1, +1): sums (-1, -3), mean -2 (grpo's would be -1)."""
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    loss, _ = grpo_loss_with(
        torch.zeros(2, 3),
        None,
        None,
        torch.ones(2),
        mask,
        loss_type="luspo",
        importance_sampling_level="sequence",
    )
    assert loss.item() == pytest.approx(-2.0)


# ---- VESPO -------------------------------------------------------------------------------------

# One sequence of two tokens, token log-ratios 0.1 and 0.2 (padding after them ignored): log w = 0.3,
# w = e^0.3 = 1.349859.
LOG_RATIO = torch.tensor([[0.1, 0.2, 7.0]])  # (1, 3)
MASK = torch.tensor([[1.0, 1.0, 0.0]])  # (1, 3)


def test_gamma_weights_by_hand():
    # A >= 0 (k 2, lambda 3): log phi = 3 + 2 x 0.3 - 3 x 1.349859 = -0.449576, phi = 0.637898
    # A < 0 (k 3, lambda 2): log phi = 2 + 3 x 0.3 - 2 x 1.349859 = 0.200282, phi = 1.221748
    pos = get_gamma_weights(torch.tensor([[1.0]]), LOG_RATIO, MASK, None)
    neg = get_gamma_weights(torch.tensor([[-1.0]]), LOG_RATIO, MASK, None)
    assert pos.item() == pytest.approx(0.6378983)
    assert neg.item() == pytest.approx(1.2217477)
    # phi(1) = e^(lambda - lambda) = 1 at any k, lambda
    assert get_gamma_weights(torch.tensor([[1.0]]), torch.zeros(1, 3), MASK, None, 5.0, 7.0).item() == 1.0


def test_gamma_weights_take_the_sampler_weights_in_log_space():
    # sampler weight 0.5 on the first token (the padding's 9 is masked): log w = 0.3 + log 0.5 = -0.393147,
    # w = 0.674929, log phi = 3 - 2 x 0.393147 - 3 x 0.674929 = 0.188806, phi = 1.207941
    weights = torch.tensor([[0.5, 1.0, 9.0]])
    assert get_gamma_weights(torch.tensor([[1.0]]), LOG_RATIO, MASK, weights).item() == pytest.approx(
        1.2079412
    )
    # A weight masked to 0 (token_mask mode): log 0 clamped to log 1e-8, so log w <= log 1e-8 + 0.3, then
    # clamped to log 1e-8: phi = e^(3 + 2 log 1e-8 - 3e-8) = 2.0e-15, the sequence practically dropped
    masked = torch.tensor([[0.0, 1.0, 1.0]])
    phi = get_gamma_weights(torch.tensor([[1.0]]), LOG_RATIO, MASK, masked).item()
    assert phi == pytest.approx(math.exp(3 + 2 * math.log(1e-8) - 3e-8))


def test_vespo_loss_and_gradient_by_hand():
    """loss = -phi A sum(log pi) / 2 tokens (dapo), phi = 0.637898 without gradient: with log pi =
    (log 0.5, log 0.25), A = 1: 0.637898 x 3 log 2 / 2 = 0.663252; d loss / d log pi_t = -phi / 2."""
    logps = torch.log(torch.tensor([[0.5, 0.25, 1.0]])).requires_grad_()
    loss, metrics = grpo_loss_with(
        logps, logps.detach() - LOG_RATIO, None, torch.tensor([1.0]), MASK, loss_type="vespo"
    )
    assert loss.item() == pytest.approx(0.6378983 * 3 * math.log(2) / 2)
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(grad, torch.tensor([[-0.6378983 / 2, -0.6378983 / 2, 0.0]]))
    assert metrics["vespo/phi_seq_mean"].item() == pytest.approx(0.6378983)


def test_vespo_takes_the_sampler_weights_instead_of_multiplying_by_them():
    """The same token with sampler weights (0.5, 1): phi = 1.207941 (above) instead of 0.637898 x 0.5."""
    logps = torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    loss, _ = grpo_loss_with(
        logps, logps - LOG_RATIO, None, torch.tensor([1.0]), MASK, loss_type="vespo",
        sampler_weights=torch.tensor([[0.5, 1.0, 9.0]]),
    )  # fmt: skip
    assert loss.item() == pytest.approx(1.2079412 * 3 * math.log(2) / 2)


# ---- Warnings for settings that do not fit -----------------------------------------------------


def config(tmp_path, **kwargs) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"importance_sampling_level": "sequence", "loss_type": "dapo"},
            ["'dapo' loss sums", "loss_type='grpo'"],
        ),
        (
            {"importance_sampling_level": "sequence", "loss_type": "cispo", "epsilon_high": 5.0},
            ["'cispo' loss sums"],
        ),
        ({"loss_type": "luspo"}, ["luspo", "importance_sampling_level='sequence'"]),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, ["vespo", "'token'"]),
        ({"loss_type": "cispo"}, ["cispo", "epsilon_high", "0.2 < 1"]),
        ({"loss_type": "sapo", "delta": 4.0}, ["delta has no effect", "'sapo'"]),
    ],
)
def test_settings_that_do_not_fit_warn(tmp_path, caplog, kwargs, words):
    with caplog.at_level(logging.WARNING, logger="grpo_hf.config.grpo_config"):
        config(tmp_path, **kwargs)
    assert len(caplog.records) == 1, caplog.text
    for word in words:
        assert word in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"importance_sampling_level": "sequence", "loss_type": "grpo"},
        {"importance_sampling_level": "sequence", "loss_type": "luspo"},
        {"loss_type": "cispo", "epsilon_high": 5.0},
        {"loss_type": "dapo", "delta": 4.0},
        {},
    ],
)
def test_settings_that_fit_do_not_warn(tmp_path, caplog, kwargs):
    with caplog.at_level(logging.WARNING, logger="grpo_hf.config.grpo_config"):
        config(tmp_path, **kwargs)
    assert not caplog.records, caplog.text


def test_delta_is_checked_only_where_it_acts(tmp_path):
    with pytest.raises(ValueError, match="delta must be > 1 \\+ epsilon_high"):
        config(tmp_path, loss_type="dapo", delta=1.1)
    assert config(tmp_path, loss_type="cispo", epsilon_high=5.0, delta=1.1).delta == 1.1  # unused: a warning
