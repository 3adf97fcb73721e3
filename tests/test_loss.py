"""The GRPO loss, term by term, on hand-made tensors whose values can be checked by hand."""

import dataclasses
import math

import pytest
import torch
from loss_settings import grpo_loss_with, loss_settings

from grpo_hf.algorithm.loss import adaptive_beta, aggregate, grpo_loss, importance_log_ratio, kl_estimate
from grpo_hf.algorithm.policy_terms import clipped_surrogate
from grpo_hf.config.grpo_config import LOSS_TYPES

LOG2 = math.log(2.0)
# One hand-made micro-batch: 2 sequences x 3 completion positions, the first one padded at t = 2.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # (B=2, T=3), 5 active tokens


def one_token(value: float) -> torch.Tensor:
    return torch.tensor([[value]])  # (B=1, T=1)


# ---- KL estimators ---------------------------------------------------------------------------


def test_kl_estimators_at_hand_picked_pairs():
    logps = torch.log(torch.tensor([[0.5, 0.25]]))  # (1, 2)
    ref = torch.log(torch.tensor([[0.25, 0.5]]))  # (1, 2)
    # x = ref - logp = (-log 2, +log 2)
    k1 = kl_estimate(logps, ref, "k1")  # -x
    k2 = kl_estimate(logps, ref, "k2")  # x^2 / 2
    k3 = kl_estimate(logps, ref, "k3")  # exp(x) - x - 1
    torch.testing.assert_close(k1, torch.tensor([[LOG2, -LOG2]]))
    torch.testing.assert_close(k2, torch.tensor([[LOG2**2 / 2, LOG2**2 / 2]]))  # 0.240227 twice
    # x = -log 2: 0.5 + log 2 - 1 = log 2 - 0.5 = 0.193147;  x = log 2: 2 - log 2 - 1 = 0.306853
    torch.testing.assert_close(k3, torch.tensor([[LOG2 - 0.5, 1 - LOG2]]))


def test_k3_is_never_negative():
    # Dense near 0 too, where exp(x) - x - 1 in float32 used to round to -6e-8.
    x = torch.cat([torch.linspace(-20, 20, 40001), torch.linspace(-1e-3, 1e-3, 20001)])  # (60002,)
    k3 = kl_estimate(torch.zeros_like(x), x, "k3")  # (60002,)
    assert (k3 >= 0).all(), k3.min()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_is_zero_when_policies_agree(estimator):
    logps = torch.log(torch.tensor([[0.9, 0.5, 1e-3]]))  # (1, 3)
    assert torch.equal(kl_estimate(logps, logps.clone(), estimator), torch.zeros(1, 3))


def test_unknown_kl_estimator_raises():
    with pytest.raises(ValueError, match="kl_estimator='k4'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---- Clipping ----------------------------------------------------------------------------------


def loss_and_grad(log_ratio: float, advantage: float, **kwargs) -> tuple[float, float, dict]:
    """Loss of a single token with the given log-ratio, and d loss / d logp."""
    logps = one_token(log_ratio).requires_grad_()  # (1, 1)
    loss, metrics = grpo_loss_with(
        logps, one_token(0.0), None, torch.tensor([advantage]), one_token(1.0), **kwargs
    )
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.item(), grad.item(), metrics


def test_positive_advantage_clipped_at_one_plus_epsilon_high():
    # ratio is e = 2.718, clipped to 1.2: loss = -min(e * 1, 1.2 * 1) = -1.2, no gradient
    loss, grad, metrics = loss_and_grad(1.0, 1.0, epsilon=0.2)
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert metrics["clip_ratio/high"].item() == 1.0
    assert metrics["clip_ratio/low"].item() == 0.0


def test_negative_advantage_clipped_at_one_minus_epsilon():
    # ratio is 1/e = 0.368, clipped to 0.8: loss = -min(0.368 * -1, 0.8 * -1) = 0.8, no gradient
    loss, grad, metrics = loss_and_grad(-1.0, -1.0, epsilon=0.2)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert metrics["clip_ratio/low"].item() == 1.0
    assert metrics["clip_ratio/high"].item() == 0.0


def test_positive_advantage_below_the_range_is_not_clipped():
    # ratio 1/e < 0.8 but A > 0: min(0.368, 0.8) keeps the unclipped 0.368, and its gradient
    # d(-r * A)/d logp = -r * A = -1/e.
    loss, grad, metrics = loss_and_grad(-1.0, 1.0, epsilon=0.2)
    assert loss == pytest.approx(-math.exp(-1))
    assert grad == pytest.approx(-math.exp(-1))
    assert metrics["clip_ratio/region"].item() == 0.0


def test_negative_advantage_above_the_range_is_not_clipped():
    # ratio e > 1.2 but A < 0: min(-e, -1.2) = -e, loss e, gradient -r * A = e.
    loss, grad, _ = loss_and_grad(1.0, -1.0, epsilon=0.2)
    assert loss == pytest.approx(math.e)
    assert grad == pytest.approx(math.e)


def test_clip_higher_uses_epsilon_high_above_and_epsilon_below():
    # epsilon 0.2, epsilon_high 0.28: ratio e with A = +1 is clipped to 1.28, not 1.2
    loss, _, _ = loss_and_grad(1.0, 1.0, epsilon=0.2, epsilon_high=0.28)
    assert loss == pytest.approx(-1.28)
    # ratio 1/e with A = -1 still stops at 1 - 0.2 = 0.8
    loss, _, _ = loss_and_grad(-1.0, -1.0, epsilon=0.2, epsilon_high=0.28)
    assert loss == pytest.approx(0.8)
    # ratio 1.25 with A = +1: inside the clip-higher range (<= 1.28), so unclipped
    loss, _, metrics = loss_and_grad(math.log(1.25), 1.0, epsilon=0.2, epsilon_high=0.28)
    assert loss == pytest.approx(-1.25)
    assert metrics["clip_ratio/high"].item() == 0.0


def test_delta_caps_the_ratio_for_negative_advantages():
    log10 = math.log(10.0)
    # Without delta: ratio 10, A = -1 -> -min(10 * -1, 1.2 * -1) = -(-10) = 10
    loss, grad, _ = loss_and_grad(log10, -1.0, epsilon=0.2)
    assert loss == pytest.approx(10.0, rel=1e-5)
    assert grad == pytest.approx(10.0, rel=1e-5)
    # delta = 4: ratio capped to 4 -> -min(4 * -1, 1.2 * -1) = -(-4) = 4, and the cap has no gradient
    loss, grad, _ = loss_and_grad(log10, -1.0, epsilon=0.2, delta=4.0)
    assert loss == pytest.approx(4.0)
    assert grad == 0.0
    # A positive advantage is clipped at 1.2 anyway: -min(4 * 1, 1.2 * 1) = -1.2
    loss, _, _ = loss_and_grad(log10, 1.0, epsilon=0.2, delta=4.0)
    assert loss == pytest.approx(-1.2)


def test_clip_metrics_on_a_hand_made_batch():
    log_ratio = torch.tensor(
        [
            [1.0, 0.0, 1.0],  # A = +1: ratio e > 1.2 (high), ratio 1, [padding: would be high]
            [-1.0, -1.0, 0.1],  # A = -1: ratio 1/e < 0.8 (low) twice, ratio 1.105 (inside)
        ]
    )  # (2, 3)
    advantages = torch.tensor([1.0, -1.0])  # (2,)
    _, metrics = grpo_loss_with(log_ratio, torch.zeros(2, 3), None, advantages, MASK, epsilon=0.2)
    # 5 active tokens: 1 clipped high, 2 clipped low
    assert metrics["clip_ratio/high"].item() == pytest.approx(1 / 5)
    assert metrics["clip_ratio/low"].item() == pytest.approx(2 / 5)
    assert metrics["clip_ratio/region"].item() == pytest.approx(3 / 5)
    assert "kl" not in metrics and "entropy" not in metrics  # beta = 0, no entropy given
    # TRL's names: the same token means, and the extremes over sequences with a token in the loss:
    # row 0 is 1/2 high-clipped, 0 low; row 1 is 2/3 low-clipped, 0 high.
    for name in ("low", "high", "region"):
        assert metrics[f"clip_ratio/{name}_mean"] == metrics[f"clip_ratio/{name}"]
    assert metrics["clip_ratio/low_min"].item() == 0.0  # min(0, 2/3)
    assert metrics["clip_ratio/high_max"].item() == pytest.approx(0.5)  # max(1/2, 0)


def test_clipped_surrogate_broadcasts_advantages_over_tokens():
    surrogate = clipped_surrogate(torch.zeros(2, 3), torch.tensor([2.0, -3.0]), 0.2, 0.2)  # (2, 3)
    assert torch.equal(surrogate, torch.tensor([[2.0, 2.0, 2.0], [-3.0, -3.0, -3.0]]))  # ratio 1: A


# ---- Aggregation per loss type -----------------------------------------------------------------

# Ratio 1 everywhere (old = current), so the per-token loss is -A: row 0 -> -1, row 1 -> +2.
# The padded token has old_logp -5 (ratio e^5, clipped to 1.2 -> -1.2): it must be masked out.
LOGPS = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])  # (2, 3)
OLD_LOGPS = torch.tensor([[-1.0, -2.0, -5.5], [-0.3, -0.7, -1.1]])  # (2, 3)
ADVANTAGES = torch.tensor([1.0, -2.0])  # (2,)
# Active per-token losses: row 0 = (-1, -1), row 1 = (2, 2, 2); sum = -2 + 6 = 4 over 5 tokens.


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        ("grpo", {}, 0.5),  # row means (-1, 2), their mean 0.5
        ("bnpo", {}, 0.8),  # 4 / 5 active tokens
        ("dr_grpo", {}, 4 / 6),  # 4 / (B=2 * max_completion_length, default T=3)
        ("dr_grpo", {"max_completion_length": 5}, 0.4),  # 4 / (2 * 5)
        ("dapo", {}, 0.8),  # 4 / 5: the micro-batch's own token count
        ("dapo", {"dapo_normalizer": 16.0}, 0.25),  # 4 / 16 tokens in the whole generation batch
        ("luspo", {}, 2.0),  # row sums (-2, 6), their mean 2
    ],
)
def test_loss_type_normalisation(loss_type, kwargs, expected):
    loss, _ = grpo_loss_with(LOGPS, OLD_LOGPS, None, ADVANTAGES, MASK, loss_type=loss_type, **kwargs)
    assert loss.item() == pytest.approx(expected)


def test_aggregate_with_per_token_values_that_vary_within_a_row():
    per_token = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 5.0]])  # (2, 3); 99 is padding
    assert aggregate(per_token, MASK, "grpo", 3).item() == pytest.approx(2.75)  # (1.5 + 4) / 2
    assert aggregate(per_token, MASK, "bnpo", 3).item() == pytest.approx(3.0)  # 15 / 5
    assert aggregate(per_token, MASK, "dr_grpo", 3).item() == pytest.approx(2.5)  # 15 / 6
    assert aggregate(per_token, MASK, "dapo", 3).item() == pytest.approx(3.0)  # 15 / 5
    assert aggregate(per_token, MASK, "dapo", 3, dapo_normalizer=10.0).item() == pytest.approx(1.5)
    assert aggregate(per_token, MASK, "luspo", 3).item() == pytest.approx(7.5)  # (3 + 12) / 2
    # The other loss types take one of these: sapo grpo's, cispo and vespo dapo's.
    assert aggregate(per_token, MASK, "sapo", 3).item() == pytest.approx(2.75)
    assert aggregate(per_token, MASK, "cispo", 3, dapo_normalizer=10.0).item() == pytest.approx(1.5)
    assert aggregate(per_token, MASK, "vespo", 3).item() == pytest.approx(3.0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregate_of_an_empty_mask_is_zero_not_nan(loss_type):
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), loss_type, 3).item() == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_batch_with_no_active_token_anywhere_has_loss_0_and_zero_gradients(loss_type):
    """The trainer's DAPO count is 0 too when every completion of the step is masked."""
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    loss, _ = grpo_loss_with(
        logps, None, logps.detach() - 0.1, torch.tensor([1.0, -1.0]), torch.zeros(2, 2), loss_type=loss_type,
        beta=0.1, dapo_normalizer=torch.tensor(0.0),
    )  # fmt: skip
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logps.grad, torch.zeros(2, 2))


def test_unknown_loss_type_raises():
    settings = dataclasses.replace(loss_settings(), loss_type="ppo")
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        grpo_loss(LOGPS, OLD_LOGPS, None, ADVANTAGES, MASK, settings)


# ---- Sequence-level ratio (GSPO) ---------------------------------------------------------------


def test_sequence_log_ratio_is_the_masked_mean_broadcast():
    logps = torch.tensor([[0.3, 0.6, 9.0], [0.1, 0.2, 0.6]])  # (2, 3)
    per_token = importance_log_ratio(logps, torch.zeros(2, 3), MASK, "token")  # (2, 3)
    per_seq = importance_log_ratio(logps, torch.zeros(2, 3), MASK, "sequence")  # (2, 3)
    assert torch.equal(per_token, logps)
    # row 0: (0.3 + 0.6) / 2 = 0.45 (the padded 9.0 is ignored); row 1: 0.9 / 3 = 0.3
    torch.testing.assert_close(per_seq, torch.tensor([[0.45] * 3, [0.3] * 3]))
    with pytest.raises(ValueError, match="importance_sampling_level='group'"):
        importance_log_ratio(logps, logps, MASK, "group")


def test_sequence_level_loss_and_gradient_by_hand():
    # One sequence, token log-ratios (0.1, -0.1, 0.3), A = +1, epsilon 0.2.
    logps = torch.tensor([[0.1, -0.1, 0.3]], requires_grad=True)  # (1, 3)
    args = (torch.zeros(1, 3), None, torch.tensor([1.0]), torch.ones(1, 3))
    # Token level: ratios e^0.1 = 1.10517, e^-0.1 = 0.90484, e^0.3 = 1.34986 -> clipped to 1.2;
    #   loss = -(1.10517 + 0.90484 + 1.2) / 3 = -1.07000
    token_loss, _ = grpo_loss_with(logps, *args, importance_sampling_level="token")
    assert token_loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.1) + 1.2) / 3)
    # Sequence level: one ratio exp(mean 0.1) = 1.10517 for all three tokens, inside [0.8, 1.2]
    seq_loss, _ = grpo_loss_with(logps, *args, importance_sampling_level="sequence")
    assert seq_loss.item() == pytest.approx(-math.exp(0.1))
    # loss = -exp(mean_t logp_t): every token gets d/d logp_t = -exp(0.1) / 3 = -0.36839
    (grad,) = torch.autograd.grad(seq_loss, logps)
    torch.testing.assert_close(grad, torch.full((1, 3), -math.exp(0.1) / 3))


# ---- Entropy bonus and KL term -----------------------------------------------------------------


ENTROPY = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])  # (2, 3); masked token mean 15 / 5 = 3


@pytest.mark.parametrize(("loss_type", "policy"), [("dapo", 0.8), ("grpo", 0.5), ("dr_grpo", 4 / 6)])
def test_entropy_bonus_is_coef_times_the_token_mean_entropy_for_every_loss_type(loss_type, policy):
    """As TRL: the bonus is not aggregated like the policy term (grpo's row means of the entropy
    would be (1.5 + 4) / 2 = 2.75, dr_grpo's 15 / 6 = 2.5); it is 0.1 x 3 for each loss type."""
    base, base_metrics = grpo_loss_with(
        LOGPS, OLD_LOGPS, None, ADVANTAGES, MASK, entropy=ENTROPY, loss_type=loss_type
    )
    bonus, metrics = grpo_loss_with(
        LOGPS, OLD_LOGPS, None, ADVANTAGES, MASK, entropy=ENTROPY, entropy_coef=0.1, loss_type=loss_type
    )
    assert base.item() == pytest.approx(policy)  # entropy_coef 0: the metric only
    assert bonus.item() == pytest.approx(policy - 0.1 * 3.0)
    assert base_metrics["entropy"].item() == pytest.approx(3.0)
    assert metrics["entropy"].item() == pytest.approx(3.0)
    assert metrics["policy_loss"].item() == pytest.approx(policy)  # the loss before the bonus


def test_a_negative_entropy_coef_is_an_entropy_penalty():
    """TRL does not restrict the sign: -0.1 adds 0.1 x the token-mean entropy 3 to dapo's 0.8."""
    loss, _ = grpo_loss_with(LOGPS, OLD_LOGPS, None, ADVANTAGES, MASK, entropy=ENTROPY, entropy_coef=-0.1)
    assert loss.item() == pytest.approx(0.8 + 0.1 * 3.0)


def test_entropy_normalizer_sets_the_bonus_denominator():
    """The trainer passes the optimizer step's token count (here 10, e.g. two micro-batches): the
    bonus is 0.1 x 15 / 10 rather than 0.1 x this micro-batch's own mean 15 / 5."""
    loss, _ = grpo_loss_with(
        LOGPS, OLD_LOGPS, None, ADVANTAGES, MASK, entropy=ENTROPY, entropy_coef=0.1, entropy_normalizer=10.0
    )
    assert loss.item() == pytest.approx(0.8 - 0.1 * 15 / 10)


def test_entropy_mask_restricts_the_policy_term_and_the_bonus():
    """Keeping (0, 1), (1, 1) and (1, 2): the policy term sums -1 + 2 + 2 = 3 over dapo's 5 tokens, and
    the bonus is 0.1 x the kept tokens' mean entropy (2 + 4 + 5) / 3."""
    kept = torch.tensor([[False, True, False], [False, True, True]])  # (2, 3)
    loss, metrics = grpo_loss_with(
        LOGPS, OLD_LOGPS, None, ADVANTAGES, MASK, entropy=ENTROPY, entropy_coef=0.1, entropy_mask=kept
    )
    assert metrics["policy_loss"].item() == pytest.approx(3 / 5)
    assert loss.item() == pytest.approx(3 / 5 - 0.1 * 11 / 3)
    assert metrics["entropy"].item() == pytest.approx(3.0)  # the metric stays over every loss token


def test_off_policy_mask_drops_whole_sequences_from_the_policy_term_only():
    """Row 1 dropped: the policy term keeps row 0's (-1, -1) over 5 tokens; the k1 KL (1 per token,
    ratio 1) stays on all 5 tokens: -2 / 5 + 0.1 x 5 / 5."""
    keep = torch.tensor([[1.0], [0.0]])  # (2, 1)
    loss, _ = grpo_loss_with(
        LOGPS, OLD_LOGPS, LOGPS - 1.0, ADVANTAGES, MASK, beta=0.1, kl_estimator="k1", off_policy_mask=keep
    )
    assert loss.item() == pytest.approx(-2 / 5 + 0.1)


def test_beta_without_ref_logps_raises():
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss_with(LOGPS, OLD_LOGPS, None, ADVANTAGES, MASK, beta=0.04)


@pytest.mark.parametrize(
    ("loss_type", "mean_kl"),
    [
        # k3 per active token: row 0 = log2 - 0.5 (x2), row 1 = 0 (x3)
        ("dapo", 2 * (LOG2 - 0.5) / 5),  # token mean: 0.077259
        ("grpo", (LOG2 - 0.5) / 2),  # mean of row means (log2 - 0.5, 0): 0.096574
    ],
)
@pytest.mark.parametrize("bias_correction", [True, False])
def test_beta_times_kl_is_added(loss_type, mean_kl, bias_correction):
    """At ratio 1 the bias correction leaves the value as it is (r KL = KL)."""
    logps = torch.full((2, 3), math.log(0.5))  # (2, 3)
    ref_logps = torch.tensor([[math.log(0.25)] * 3, [math.log(0.5)] * 3])  # (2, 3)
    advantages = torch.tensor([1.0, -1.0])  # (2,)
    common = dict(loss_type=loss_type, use_bias_correction_kl=bias_correction)
    no_kl, _ = grpo_loss_with(logps, logps, ref_logps, advantages, MASK, beta=0.0, **common)
    with_kl, metrics = grpo_loss_with(logps, logps, ref_logps, advantages, MASK, beta=0.04, **common)
    assert (with_kl - no_kl).item() == pytest.approx(0.04 * mean_kl, rel=1e-5)
    assert metrics["kl"].item() == pytest.approx(2 * (LOG2 - 0.5) / 5, rel=1e-5)  # token mean


@pytest.mark.parametrize(("bias_correction", "grad"), [(False, 0.5), (True, LOG2)])
def test_bias_corrected_k3_gradient_at_ratio_one(bias_correction, grad):
    """One token, logp = log 0.5, ref = log 0.25, x = ref - logp = -log 2, A = 0, beta = 1.
    k3 = e^x - x - 1, d k3 / d logp = 1 - e^x = 0.5. Corrected, r k3 with r = e^(logp - old):
    d / d logp = r k3 + r (1 - e^x) = (log 2 - 0.5) + 0.5 = log 2 at r = 1 (k1's value, logp - ref)."""
    logps = one_token(math.log(0.5)).requires_grad_()
    loss, _ = grpo_loss_with(
        logps, None, one_token(math.log(0.25)), torch.tensor([0.0]), one_token(1.0), beta=1.0,
        use_bias_correction_kl=bias_correction,
    )  # fmt: skip
    assert loss.item() == pytest.approx(LOG2 - 0.5)  # r = 1: the same value either way
    assert torch.autograd.grad(loss, logps)[0].item() == pytest.approx(grad)


def test_bias_corrected_kl_is_weighted_by_the_ratio_off_policy():
    """logp = log 0.5, old = logp - 0.5 (r = e^0.5 = 1.64872), ref = log 0.25: k3 = log 2 - 0.5 =
    0.193147, corrected 1.64872 x 0.193147 = 0.318446; A = 0 leaves the KL alone (beta = 1)."""
    logps, ref = one_token(math.log(0.5)), one_token(math.log(0.25))
    args = (logps, logps - 0.5, ref, torch.tensor([0.0]), one_token(1.0))
    corrected, metrics = grpo_loss_with(*args, beta=1.0)
    plain, _ = grpo_loss_with(*args, beta=1.0, use_bias_correction_kl=False)
    assert plain.item() == pytest.approx(LOG2 - 0.5)
    assert corrected.item() == pytest.approx(math.exp(0.5) * (LOG2 - 0.5))
    assert metrics["kl"].item() == pytest.approx(math.exp(0.5) * (LOG2 - 0.5))  # TRL logs the weighted KL


def test_kl_estimator_is_passed_through():
    logps = one_token(math.log(0.5))
    ref = one_token(math.log(0.25))
    _, metrics = grpo_loss_with(
        logps, logps, ref, torch.tensor([0.0]), one_token(1.0), beta=0.1, kl_estimator="k1"
    )
    assert metrics["kl"].item() == pytest.approx(LOG2)  # k1 = -x = log 2


# ---- Gradient: at ratio 1 the surrogate is the policy gradient ---------------------------------


HAND_AGGREGATE = {
    "grpo": lambda v, m: ((v * m).sum(dim=1) / m.sum(dim=1)).mean(),  # per-sequence mean, then mean
    "bnpo": lambda v, m: (v * m).sum() / 5,
    "dr_grpo": lambda v, m: (v * m).sum() / (2 * 3),
    "dapo": lambda v, m: (v * m).sum() / 5,
    "luspo": lambda v, m: (v * m).sum(dim=1).mean(),  # per-sequence sum, then mean
}
HAND_AGGREGATE |= {
    "sapo": HAND_AGGREGATE["grpo"],
    "cispo": HAND_AGGREGATE["dapo"],
    "vespo": HAND_AGGREGATE["dapo"],
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradient_at_ratio_one_is_advantage_times_grad_logp(loss_type):
    """Every policy term is the policy gradient at r = 1: the clip does not bind, CISPO's weight is
    min(1, epsilon_high = 5) = 1, SAPO's gate has slope 4 sigmoid'(0) = 1, VESPO's phi(1) = 1."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 5)  # theta: a tiny policy over a vocabulary of 5
    features = torch.randn(2, 3, 4)  # (B, T, hidden)
    targets = torch.randint(0, 5, (2, 3))  # (B, T)
    advantages = torch.tensor([1.5, -0.5])  # (B,)

    def policy_logps() -> torch.Tensor:
        logits = layer(features)  # (B, T, V)
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)

    logps = policy_logps()  # (B, T)
    loss, _ = grpo_loss_with(
        logps, logps.detach(), None, advantages, MASK, loss_type=loss_type, epsilon_high=5.0
    )
    got = torch.autograd.grad(loss, list(layer.parameters()))
    # By hand: the policy-gradient loss -A * log pi, aggregated the same way.
    pg_loss = HAND_AGGREGATE[loss_type](-advantages.unsqueeze(1) * policy_logps(), MASK)
    want = torch.autograd.grad(pg_loss, list(layer.parameters()))
    for g, w in zip(got, want, strict=True):
        assert w.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    # The value is -mean(A) in the same aggregation (ratio exactly 1): the logged loss is not the
    # gradient. SAPO's gate is 4 sigmoid(0) / tau = 2 / tau at r = 1 (tau 1 for A > 0, 1.05 else);
    # CISPO's and VESPO's value is the policy-gradient loss -A log pi itself.
    values = {
        "sapo": -advantages.unsqueeze(1).expand(2, 3) * torch.tensor([[2.0], [2 / 1.05]]),
        "cispo": -advantages.unsqueeze(1) * logps.detach(),
        "vespo": -advantages.unsqueeze(1) * logps.detach(),
    }.get(loss_type, -advantages.unsqueeze(1).expand(2, 3))
    assert loss.item() == pytest.approx(HAND_AGGREGATE[loss_type](values, MASK).item(), rel=1e-5)


def test_old_logps_none_means_same_policy():
    logps = LOGPS.clone().requires_grad_()
    loss_none, _ = grpo_loss_with(logps, None, None, ADVANTAGES, MASK)
    loss_detached, _ = grpo_loss_with(logps, logps.detach(), None, ADVANTAGES, MASK)
    assert loss_none.item() == loss_detached.item()
    torch.testing.assert_close(
        torch.autograd.grad(loss_none, logps)[0], torch.autograd.grad(loss_detached, logps)[0]
    )


# ---- Adaptive KL controller --------------------------------------------------------------------


def test_adaptive_beta_hand_values():
    # n / H = 100 / 10000 = 0.01
    # KL 0.02 is 100% above target 0.01: error clipped to +0.2 -> beta * (1 + 0.2 * 0.01) = 0.1002
    assert adaptive_beta(0.1, kl=0.02, target_kl=0.01, num_samples=100, horizon=10000) == pytest.approx(
        0.1002
    )
    # KL 0.001 is 90% below: error clipped to -0.2 -> 0.1 * (1 - 0.002) = 0.0998
    assert adaptive_beta(0.1, kl=0.001, target_kl=0.01, num_samples=100, horizon=10000) == pytest.approx(
        0.0998
    )
    # KL 0.011 is 10% above: error 0.1, not clipped -> 0.1 * (1 + 0.1 * 0.01) = 0.1001
    assert adaptive_beta(0.1, kl=0.011, target_kl=0.01, num_samples=100, horizon=10000) == pytest.approx(
        0.1001
    )
    # Exactly at target: unchanged
    assert adaptive_beta(0.1, kl=0.01, target_kl=0.01, num_samples=100, horizon=10000) == 0.1


def test_sampler_weights_scale_the_policy_term_only():
    """beta = 0.1 k1 with ref = logp - 1 (KL 1 per token), A = 1, ratio 1: per token -w + 0.1."""
    logps = torch.zeros(1, 2, requires_grad=True)
    weights = torch.tensor([[0.5, 2.0]])
    loss, _ = grpo_loss_with(
        logps, None, logps.detach() - 1.0, torch.tensor([1.0]), torch.ones(1, 2), loss_type="bnpo", beta=0.1,
        kl_estimator="k1", sampler_weights=weights,
    )  # fmt: skip
    assert loss.item() == pytest.approx(((-0.5 + 0.1) + (-2.0 + 0.1)) / 2)
