"""Token log-probs and entropy from logits, and from hidden states through a frozen LM head."""

import math

import pytest
import torch

from grpo_hf.algorithm.sampler_correction import Truncation
from grpo_hf.engine import token_scores
from grpo_hf.engine.token_scores import token_logps_and_entropy


def direct(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """The plain (B, C, V) computation the row-by-row one must match."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, C, V)
    logps = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, C)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)  # (B, C)
    return logps, entropy


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_matches_direct_log_softmax(temperature):
    torch.manual_seed(0)
    logits = 3 * torch.randn(2, 4, 7)  # (B, C, V)
    targets = torch.randint(0, 7, (2, 4))  # (B, C)
    logps, entropy, _ = token_logps_and_entropy(logits, targets, temperature, with_entropy=True)
    want_logps, want_entropy = direct(logits, targets, temperature)
    assert logps.shape == entropy.shape == (2, 4)
    torch.testing.assert_close(logps, want_logps)
    torch.testing.assert_close(entropy, want_entropy)


def test_temperature_divides_the_logits():
    logits = torch.tensor([[[2.0, 0.0]]])  # (1, 1, 2)
    # temperature 2 -> logits (1, 0): log p(0) = 1 - log(e + 1) = -0.313262
    logps, _, _ = token_logps_and_entropy(logits, torch.tensor([[0]]), temperature=2.0)
    assert logps.item() == pytest.approx(1 - math.log(math.e + 1))


def test_uniform_distribution_has_entropy_log_v():
    V = 8
    logits = torch.full((1, 3, V), 5.0)  # (1, 3, V): equal logits, any temperature
    logps, entropy, _ = token_logps_and_entropy(
        logits, torch.zeros(1, 3, dtype=torch.long), 2.0, with_entropy=True
    )
    torch.testing.assert_close(entropy, torch.full((1, 3), math.log(V)))  # log 8 = 2.0794
    torch.testing.assert_close(logps, torch.full((1, 3), -math.log(V)))


def test_bf16_logits_are_computed_in_float32():
    torch.manual_seed(0)
    logits = (4 * torch.randn(2, 3, 11)).to(torch.bfloat16)  # (B, C, V) bf16
    targets = torch.randint(0, 11, (2, 3))  # (B, C)
    logps, entropy, _ = token_logps_and_entropy(logits, targets, with_entropy=True)
    assert logps.dtype == entropy.dtype == torch.float32
    want_logps, want_entropy = direct(logits.float(), targets)  # the bf16 values, upcast first
    torch.testing.assert_close(logps, want_logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-6, atol=1e-6)


def test_no_entropy_unless_asked():
    logps, entropy, _ = token_logps_and_entropy(torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long))
    assert entropy is None
    assert logps.shape == (1, 2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_of_logps_and_entropy_match_finite_differences(temperature, monkeypatch):
    monkeypatch.setattr(token_scores, "TOKENS_PER_CHUNK", 2)  # 5 tokens: chunks of 2, 2 and 1
    torch.manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)  # (M, V)
    targets = torch.tensor([0, 3, 6, 2, 2])
    # gradcheck needs float64 throughout; the function computes in float32, so cast around it.
    torch.autograd.gradcheck(
        lambda x: token_logps_and_entropy(x, targets, temperature, with_entropy=True)[:2],
        (logits,),
        eps=1e-3,
        atol=2e-3,
        rtol=1e-2,
    )


def test_gradients_match_autograd_through_log_softmax():
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 3, 11)).requires_grad_()  # (B, C, V)
    targets = torch.randint(0, 11, (2, 3))
    weights = torch.randn(2, 2, 3)  # arbitrary upstream gradients for log-probs and entropy
    logps, entropy, _ = token_logps_and_entropy(logits, targets, 0.8, with_entropy=True)
    both = (logps * weights[0]).sum() + (entropy * weights[1]).sum()
    (ours,) = torch.autograd.grad(both, logits, retain_graph=True)
    want_logps, want_entropy = direct(logits, targets, 0.8)
    want_both = (want_logps * weights[0]).sum() + (want_entropy * weights[1]).sum()
    (want,) = torch.autograd.grad(want_both, logits, retain_graph=True)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    (logps_only,) = torch.autograd.grad((logps * weights[0]).sum(), logits)  # entropy unused: no term
    (want_logps_only,) = torch.autograd.grad((want_logps * weights[0]).sum(), logits)
    torch.testing.assert_close(logps_only, want_logps_only, rtol=1e-5, atol=1e-6)


def test_logits_far_below_the_max_change_nothing():
    """Shifted logits below EXP_FLOOR (-87) are clamped before exp: no effect on values or gradients."""
    torch.manual_seed(0)
    logits = torch.cat([torch.zeros(3, 1), -300 * torch.rand(3, 50), torch.randn(3, 4)], dim=1)  # (M, V)
    logits.requires_grad_()
    targets = torch.tensor([0, 20, 52])  # the max, a token at about -120, an ordinary one
    logps, entropy, _ = token_logps_and_entropy(logits, targets, with_entropy=True)
    want_logps, want_entropy = direct(logits, targets)  # log_softmax: no clamping
    assert want_logps[1] < -100  # the target far below the max keeps its exact log-prob
    torch.testing.assert_close(logps, want_logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(logps.sum() + entropy.sum(), logits, retain_graph=True)
    (want,) = torch.autograd.grad(want_logps.sum() + want_entropy.sum(), logits)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def test_bf16_logits_get_bf16_gradients_and_nothing_is_kept_without_grad():
    logits = torch.randn(4, 9).to(torch.bfloat16).requires_grad_()
    logps, _, _ = token_logps_and_entropy(logits, torch.zeros(4, dtype=torch.long))
    (grad,) = torch.autograd.grad(logps.sum(), logits)
    assert grad.dtype == torch.bfloat16
    with torch.no_grad():
        logps, entropy, _ = token_logps_and_entropy(
            logits, torch.zeros(4, dtype=torch.long), with_entropy=True
        )
    assert not logps.requires_grad and not entropy.requires_grad


# ---- A frozen LM head fused with the log-softmax ---------------------------------------------


def head_scores(hidden, weight, targets, temperature=1.0, dtype=torch.float32):
    """`head_token_logps` on (M, E) hidden states and a (V, E) head weight, with the entropy."""
    return token_scores.head_token_logps(hidden, weight, targets, temperature, True, dtype)


def test_fused_head_by_hand():
    # logits = h @ W^T = [ln 2, 0, ln 2]: p = (2/5, 1/5, 2/5)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # (V, E) = (3, 2)
    hidden = torch.tensor([[math.log(2), 0.0]], requires_grad=True)  # (M, E) = (1, 2)
    logps, entropy, _ = head_scores(hidden, weight, torch.tensor([0]))
    torch.testing.assert_close(logps, torch.tensor([math.log(0.4)]))
    torch.testing.assert_close(entropy, torch.tensor([-(2 * 0.4 * math.log(0.4) + 0.2 * math.log(0.2))]))
    assert not entropy.requires_grad  # a metric here; an entropy bonus takes the unfused path
    (grad,) = torch.autograd.grad(3 * logps.sum(), hidden)
    # d log p_0 / d h = (onehot(0) - p) @ W = (0.6, -0.2, -0.4) @ W = (0.6 - 0.4, -0.2 - 0.4)
    torch.testing.assert_close(grad, 3 * torch.tensor([[0.2, -0.6]]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_matches_autograd_through_the_logits(temperature, monkeypatch):
    monkeypatch.setattr(token_scores, "HEAD_TOKENS_PER_CHUNK", 3)  # 5 tokens: products of 3 and 2 rows,
    monkeypatch.setattr(token_scores, "TOKENS_PER_CHUNK", 2)  # log-softmax of 2 and 1, then 2 rows
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 4, requires_grad=True), torch.randn(11, 4)  # (M, E), (V, E)
    targets, upstream = torch.tensor([0, 3, 10, 2, 2]), torch.randn(5)
    logps, entropy, _ = head_scores(hidden, weight, targets, temperature)
    want_logps, want_entropy = direct(hidden @ weight.T, targets, temperature)
    torch.testing.assert_close(logps, want_logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad((logps * upstream).sum(), hidden)
    (want,) = torch.autograd.grad((want_logps * upstream).sum(), hidden)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def test_fused_head_takes_products_in_the_given_dtype():
    torch.manual_seed(0)
    hidden, weight, targets = torch.randn(3, 8), torch.randn(13, 8), torch.tensor([1, 5, 12])
    logps, _, _ = head_scores(hidden, weight, targets, dtype=torch.bfloat16)
    logits = hidden.bfloat16() @ weight.bfloat16().T  # (M, V) what the head computes under bf16 autocast
    torch.testing.assert_close(logps, direct(logits, targets)[0], rtol=1e-6, atol=1e-6)
    assert (logps - direct(hidden @ weight.T, targets)[0]).abs().max() > 1e-4  # bf16 really was used


def test_frozen_head_is_cast_once_until_it_changes():
    weight = torch.randn(6, 4)
    first = token_scores._cast_frozen(weight, torch.bfloat16)
    assert token_scores._cast_frozen(weight, torch.bfloat16) is first
    assert token_scores._cast_frozen(weight, torch.float32) is weight
    with torch.no_grad():
        weight.mul_(2)  # an in-place write bumps the version counter
    second = token_scores._cast_frozen(weight, torch.bfloat16)
    assert second is not first and torch.equal(second, weight.bfloat16())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainable_head_matches_autograd_through_the_logits(temperature, monkeypatch):
    """Full fine-tuning / an entropy bonus: the head's product recomputed in backward, chunk by chunk."""
    monkeypatch.setattr(token_scores, "HEAD_TOKENS_PER_CHUNK", 3)
    monkeypatch.setattr(token_scores, "TOKENS_PER_CHUNK", 2)
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 4, requires_grad=True), torch.randn(11, 4, requires_grad=True)
    targets, upstream, entropy_upstream = torch.tensor([0, 3, 10, 2, 2]), torch.randn(5), torch.randn(5)
    logps, entropy, _ = token_scores.head_token_logps(
        hidden, weight, targets, temperature, True, torch.float32, entropy_grad=True
    )
    assert entropy.requires_grad
    want_logps, want_entropy = direct(hidden @ weight.T, targets, temperature)
    torch.testing.assert_close(logps, want_logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-6, atol=1e-6)
    loss = (logps * upstream).sum() + (entropy * entropy_upstream).sum()
    want_loss = (want_logps * upstream).sum() + (want_entropy * entropy_upstream).sum()
    grads = torch.autograd.grad(loss, (hidden, weight))
    for grad, want in zip(grads, torch.autograd.grad(want_loss, (hidden, weight)), strict=True):
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def test_trainable_head_keeps_no_vocabulary_sized_tensor_for_backward():
    """What backward keeps: the hidden states, the weight itself and a few numbers per token."""
    hidden, weight = torch.randn(40, 8, requires_grad=True), torch.randn(1000, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_scores.head_token_logps(
            hidden, weight, torch.zeros(40, dtype=torch.long), 1.0, True, torch.float32
        )
    assert weight.data_ptr() in {t.data_ptr() for t in saved}  # the parameter itself, not a copy
    assert max(t.numel() for t in saved) == weight.numel()  # 8,000 elements; the (M, V) logits are 40,000


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen-head", "trained-head"])
def test_every_pass_takes_the_same_kept_mass(trainable, monkeypatch):
    """The fused heads (chunked products) give the kept log-mass of a truncation the logits' pass gives
    (its values by hand: test_sampler_correction), and none without one."""
    monkeypatch.setattr(token_scores, "HEAD_TOKENS_PER_CHUNK", 3)
    monkeypatch.setattr(token_scores, "TOKENS_PER_CHUNK", 2)
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 4), torch.randn(11, 4, requires_grad=trainable)  # (M, E), (V, E)
    targets, truncation = torch.tensor([0, 3, 10, 2, 2]), Truncation(top_k=4, top_p=0.8)
    fused = token_scores.head_token_logps(
        hidden, weight, targets, 0.7, False, torch.float32, truncation=truncation
    )
    plain = token_logps_and_entropy(hidden @ weight.T, targets, 0.7, truncation=truncation)
    torch.testing.assert_close(fused.kept_log_mass, plain.kept_log_mass)
    assert not fused.kept_log_mass.requires_grad and (plain.kept_log_mass < 0).any()
    assert (
        token_scores.head_token_logps(hidden, weight, targets, 0.7, False, torch.float32).kept_log_mass
        is None
    )
