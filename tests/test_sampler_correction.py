"""Importance sampling against the sampler: the four modes by hand, which settings apply to which
backend, TRL's checks and warnings, and the metrics."""

import logging
import math

import pytest
import torch

from grpo_hf.algorithm.sampler_correction import SamplerCorrection, sampler_is_weights, sampler_metrics
from grpo_hf.config.grpo_config import GRPOConfig
from grpo_hf.config.loss_args import check_sampler_settings, sampler_correction
from grpo_hf.engine import quantization
from grpo_hf.engine.quantization import Int8Matmul

# Row 0: pi_old (0.5, 0.2, 0.3) against the sampler's (0.25, 0.4, 0.1): ratios 2, 0.5, 3, product 3.
# Row 1: (0.5, 0.4, pad) against (0.4, 0.5, pad): ratios 1.25, 0.8, product 1; its padding's
# log-probs differ (-5 vs 0) but are out of the loss.
OLD = torch.log(torch.tensor([[0.5, 0.2, 0.3], [0.5, 0.4, math.exp(-5)]]))  # (2, 3)
SAMPLER = torch.log(torch.tensor([[0.25, 0.4, 0.1], [0.4, 0.5, 1.0]]))  # (2, 3)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max", "expected"),
    [
        ("token_truncate", None, 2.5, [[2.0, 0.5, 2.5], [1.25, 0.8, 1.0]]),
        ("token_truncate", 0.6, 2.5, [[2.0, 0.6, 2.5], [1.25, 0.8, 1.0]]),
        ("token_mask", 0.6, 2.5, [[2.0, 0.0, 0.0], [1.25, 0.8, 1.0]]),
        ("token_mask", 0.9, None, [[2.0, 0.0, 3.0], [1.25, 0.0, 1.0]]),
        ("sequence_truncate", None, 2.5, [[2.5] * 3, [1.0] * 3]),  # 3 capped at 2.5; 1.25 x 0.8 = 1
        ("sequence_truncate", 1.5, 4.0, [[3.0] * 3, [1.5] * 3]),  # 1 raised to 1.5
        ("sequence_mask", None, 2.5, [[0.0] * 3, [1.0] * 3]),  # 3 > 2.5: the whole row out
        ("sequence_mask", None, 3.5, [[3.0] * 3, [1.0] * 3]),
    ],
)
def test_modes_by_hand(mode, clip_min, clip_max, expected):
    weights = sampler_is_weights(OLD, SAMPLER, MASK, SamplerCorrection(mode, clip_min, clip_max))
    torch.testing.assert_close(weights, torch.tensor(expected))


def test_an_unscored_token_counts_as_ratio_one():
    sampler = SAMPLER.clone()
    sampler[0, 2] = math.nan  # 2 x 0.5 x 1 = 1 for the row
    weights = sampler_is_weights(OLD, sampler, MASK, SamplerCorrection("sequence_mask", None, 3.0))
    torch.testing.assert_close(weights[0], torch.ones(3))


def test_under_truncation_the_weight_is_the_mass_the_truncation_kept():
    """top_k=2 on p = (0.4, 0.3, 0.2, 0.1): the sampler draws from (0.4, 0.3) / 0.7 and records log(p / 0.7)
    (test_rollout); pi_old is p over the whole vocabulary. A drawn token's rho = p / (p / 0.7) = 0.7: the
    importance weight from the distribution sampled to the policy (the cut 0.3 is never drawn)."""
    p = torch.tensor([[0.4, 0.3]])  # (1, T) the two tokens drawn
    weights = sampler_is_weights(p.log(), (p / 0.7).log(), torch.ones(1, 2), SamplerCorrection("token_mask"))
    torch.testing.assert_close(weights, torch.tensor([[0.7, 0.7]]))


def test_metrics_by_hand():
    """Five loss tokens, ratios 2, 0.5, 3, 1.25, 0.8: mean 7.55 / 5 = 1.51, min 0.5, max 3; |log ratio|:
    log 2, log 2, log 3, log 1.25, log 1.25 -> mean (2 log 2 + log 3 + 2 log 1.25) / 5, max log 3.
    k3 = r - 1 - log r summed: 7.55 - 5 - (log 2 - log 2 + log 3 + log 1.25 - log 1.25) = 2.55 - log 3.
    Weights of sequence_mask at 2.5: 0 on row 0's three tokens, 1 on row 1's two: min 0, mean 2 / 5, max 1."""
    weights = sampler_is_weights(OLD, SAMPLER, MASK, SamplerCorrection("sequence_mask", None, 2.5))
    metrics = {k: v.item() for k, v in sampler_metrics(OLD, SAMPLER, MASK, weights).items()}
    assert metrics == pytest.approx(
        {
            "sampler/ratio_mean": 7.55 / 5,
            "sampler/ratio_min": 0.5,
            "sampler/ratio_max": 3.0,
            "sampler/kl": (2.55 - math.log(3)) / 5,
            "sampling/sampling_logp_difference/mean": (2 * math.log(2) + math.log(3) + 2 * math.log(1.25))
            / 5,
            "sampling/sampling_logp_difference/max": math.log(3),
            "sampling/importance_sampling_ratio/min": 0.0,
            "sampling/importance_sampling_ratio/mean": 0.4,
            "sampling/importance_sampling_ratio/max": 1.0,
        }
    )
    without = sampler_metrics(OLD, SAMPLER, MASK, None)
    assert not any(name.startswith("sampling/importance") for name in without)
    empty = sampler_metrics(OLD, SAMPLER, torch.zeros(2, 3), weights)  # no loss token: extremes -inf / inf
    assert empty["sampler/ratio_max"].item() == -math.inf
    assert empty["sampler/ratio_min"].item() == math.inf
    assert empty["sampling/importance_sampling_ratio/min"].item() == math.inf


def test_weights_of_an_int8_sampler_by_hand(monkeypatch):
    """A 3-token vocabulary, hidden state (1, 1), head rows (1, 0.3), (0.2, 0.9), (-0.5, 0.25): the
    policy's logits are the row sums 1.3, 1.1, -0.25. Rounded per row to int8 (scale max|w| / 127):
    row 0 (1, 38/127), row 1 (28 * 0.9/127, 0.9), row 2 (-0.5, 64 * 0.5/127) (0.25 / (0.5/127) = 63.5
    rounds to even), so the int8 sampler's logits are 1 + 38/127, 0.9 + 25.2/127, -0.5 + 32/127.
    Tokens 1 and 2 drawn: rho_t = softmax(policy)_t / softmax(sampler)_t, token_truncate to [0.998, 1.0005]."""
    monkeypatch.setattr(quantization, "int8_kernel_supported", lambda: False)  # float activations: exact
    head = torch.tensor([[1.0, 0.3], [0.2, 0.9], [-0.5, 0.25]])
    hidden = torch.ones(2, 2)  # (T, E): the same state at both tokens
    policy_logits = [1.3, 1.1, -0.25]
    sampler_logits = [1 + 38 / 127, 0.9 + 25.2 / 127, -0.5 + 32 / 127]
    torch.testing.assert_close(Int8Matmul(head)(hidden)[0], torch.tensor(sampler_logits))
    tokens = torch.tensor([1, 2])
    old = torch.log_softmax(hidden @ head.T, dim=-1).gather(1, tokens[:, None]).T  # (1, T)
    sampler = torch.log_softmax(Int8Matmul(head)(hidden), dim=-1).gather(1, tokens[:, None]).T
    weights = sampler_is_weights(
        old, sampler, torch.ones(1, 2), SamplerCorrection("token_truncate", 0.998, 1.0005)
    )

    def softmax(logits: list[float], t: int) -> float:
        return math.exp(logits[t]) / sum(math.exp(z) for z in logits)

    rho = [softmax(policy_logits, t) / softmax(sampler_logits, t) for t in (1, 2)]
    # rho_1 = 1.000759..., rho_2 = 0.997219...: each past one bound, so clamped to it.
    assert rho[1] < 0.998 < 1.0005 < rho[0]
    torch.testing.assert_close(weights, torch.tensor([[1.0005, 0.998]]))
    unbounded = sampler_is_weights(
        old, sampler, torch.ones(1, 2), SamplerCorrection("token_truncate", None, None)
    )
    torch.testing.assert_close(unbounded, torch.tensor([rho]))


# ---- Which correction applies, and TRL's checks ------------------------------------------------


def config(tmp_path, **kwargs) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kwargs)


def with_vllm(args: GRPOConfig) -> GRPOConfig:
    """`generation_backend == "vllm"` after __post_init__ is the vLLM backend's contract (issue 22)."""
    args.generation_backend = "vllm"
    args.check_loss_combinations()
    return args


def test_our_decoder_uses_sampler_is_cap_and_vllm_uses_trl_settings(tmp_path):
    args = config(tmp_path)
    assert (args.vllm_importance_sampling_correction, args.vllm_importance_sampling_mode) == (
        True,
        "sequence_mask",
    )
    assert args.vllm_importance_sampling_clip_max == 3.0 and args.vllm_importance_sampling_clip_min is None
    assert sampler_correction(args) is None  # our decoder: off unless sampler_is_cap
    assert sampler_correction(config(tmp_path, sampler_is_cap=2.0)) == SamplerCorrection(
        "token_truncate", None, 2.0
    )
    assert sampler_correction(with_vllm(config(tmp_path))) == SamplerCorrection("sequence_mask", None, 3.0)
    trl = with_vllm(
        config(
            tmp_path,
            vllm_importance_sampling_mode="token_mask",
            vllm_importance_sampling_clip_min=0.5,
            vllm_importance_sampling_clip_max=None,
        )
    )
    assert sampler_correction(trl) == SamplerCorrection("token_mask", 0.5, None)
    assert sampler_correction(with_vllm(config(tmp_path, vllm_importance_sampling_correction=False))) is None


def test_deprecated_cap_warns_and_sets_clip_max(tmp_path):
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_clip_max"):
        args = config(tmp_path, vllm_importance_sampling_cap=5.0)
    assert args.vllm_importance_sampling_clip_max == 5.0


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (
            {"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 2.0},
            ["vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"],
        ),
        (
            {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
            ["vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"],
        ),
        ({"vllm_importance_sampling_mode": "token"}, ["vllm_importance_sampling_mode"]),
        ({"vllm_importance_sampling_clip_max": 0.0}, ["vllm_importance_sampling_clip_max"]),
        ({"vllm_importance_sampling_clip_min": -1.0}, ["vllm_importance_sampling_clip_min"]),
        ({"sampler_is_cap": 0.0}, ["sampler_is_cap"]),
    ],
)
def test_errors_name_the_setting(tmp_path, kwargs, names):
    with pytest.raises(ValueError) as error:
        config(tmp_path, **kwargs)
    for name in names:
        assert name in str(error.value)


def test_truncation_without_bounds_is_fine_when_the_correction_is_off(tmp_path):
    args = config(
        tmp_path,
        vllm_importance_sampling_correction=False,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=None,
    )
    check_sampler_settings(args)


def test_vllm_errors_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match="sampler_is_cap"):
        with_vllm(config(tmp_path, sampler_is_cap=2.0))
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode.*'sequence_mask'"):
        with_vllm(config(tmp_path, loss_type="vespo"))  # TRL's default mode is sequence-level
    args = with_vllm(config(tmp_path, loss_type="vespo", vllm_importance_sampling_mode="token_truncate"))
    assert sampler_correction(args).mode == "token_truncate"
    with_vllm(
        config(tmp_path, loss_type="vespo", vllm_importance_sampling_correction=False)
    )  # no weights: fine


@pytest.mark.parametrize(
    ("kwargs", "cut"),
    [
        ({"top_k": 2}, "top_k"),
        ({"top_p": 0.9, "min_p": 0.1}, "top_p / min_p"),
        ({"generation_kwargs": {"top_k": 5}}, "top_k"),  # generation_kwargs override the fields
        ({"use_vllm": True, "vllm_mode": "server", "top_p": 0.9}, "top_p"),
        ({}, None),
        ({"min_p": 0.0, "generation_kwargs": {"top_k": -1}}, None),  # vLLM's top_k -1 is off
    ],
)
def test_truncated_sampling_is_warned_about_whatever_the_backend(tmp_path, caplog, kwargs, cut):
    with caplog.at_level(logging.WARNING, logger="grpo_hf.config.generation_args"):
        config(tmp_path, **kwargs)
    warned = "truncate the sampling distribution" in caplog.text
    assert warned == (cut is not None)
    if cut:
        assert f"{cut} truncate the sampling distribution" in caplog.text
        assert "probability mass the truncation kept" in caplog.text
