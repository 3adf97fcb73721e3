"""Importance sampling against the sampler: the four modes by hand, which settings apply to which
backend, TRL's checks and warnings, and the metrics."""

import logging
import math

import pytest
import torch
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, length_reward, make_config

from grpo_hf import GRPOTrainer
from grpo_hf.algorithm.sampler_correction import (
    SamplerCorrection,
    Truncation,
    kept_floor,
    on_policy_support,
    sampler_is_weights,
    sampler_metrics,
)
from grpo_hf.config.grpo_config import GRPOConfig
from grpo_hf.config.loss_args import check_sampler_settings, sampler_correction
from grpo_hf.engine import quantization
from grpo_hf.engine.quantization import Int8Matmul
from grpo_hf.engine.token_scores import token_logps_and_entropy

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
def test_truncated_sampling_without_renormalizing_is_warned_about_whatever_the_backend(
    tmp_path, caplog, kwargs, cut
):
    """Only renormalize_truncated_sampling=False puts the kept mass in the weights: warned then alone."""
    with caplog.at_level(logging.WARNING, logger="grpo_hf.config.generation_args"):
        config(tmp_path, **kwargs)
        assert "truncate the sampling distribution" not in caplog.text  # renormalised: nothing to warn of
        config(tmp_path, renormalize_truncated_sampling=False, **kwargs)
    warned = "truncate the sampling distribution" in caplog.text
    assert warned == (cut is not None)
    if cut:
        assert f"{cut} truncate the sampling distribution" in caplog.text
        assert "probability mass the truncation kept" in caplog.text


# ---- The truncated support (renormalize_truncated_sampling) ---------------------------------------

P = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])  # pi_old over a 5-token vocabulary, at temperature 1


@pytest.mark.parametrize(
    ("truncation", "kept"),
    [
        (Truncation(top_k=2), [0, 1]),  # mass 0.65
        (Truncation(top_p=0.7), [0, 1, 2]),  # mass before each: 0, 0.4, 0.65 < 0.7; 0.85 is not: 0.85
        (Truncation(min_p=0.3), [0, 1, 2]),  # p >= 0.3 x 0.4 = 0.12: 0.85
        # top_p over top_k's (0.4, 0.25, 0.2) / 0.85: before each 0, 0.47, 0.76 >= 0.7: 0.65
        (Truncation(top_k=3, top_p=0.7), [0, 1]),
        # transformers: top_p 0.88 first (before each 0, 0.4, 0.65, 0.85 < 0.88, 0.95), then min_p
        # (p >= 0.2 x 0.4 = 0.08) keeps those four: 0.95
        (Truncation(top_p=0.88, min_p=0.2), [0, 1, 2, 3]),
        # vLLM: min_p first keeps four (0.95); top_p over them / 0.95: before each 0, 0.42, 0.68, 0.89: 0.85
        (Truncation(top_p=0.88, min_p=0.2, min_p_first=True), [0, 1, 2]),
    ],
)
def test_the_kept_support_and_its_mass_by_hand(truncation, kept):
    """The support the trainer replays, and the log of pi_old's mass on it that its log-prob pass takes
    per token: the drawn token is always in (token 4, cut everywhere, adds its 0.05)."""
    z = P.log().expand(5, 5)  # (5, V): one row per drawn token 0..4
    assert (z[0] >= kept_floor(z[:1], truncation)).nonzero().flatten().tolist() == kept
    scores = token_logps_and_entropy(z, torch.arange(5), truncation=truncation)
    mass = P[kept].sum()
    want = torch.stack([mass + (0 if t in kept else P[t]) for t in range(5)]).log()  # (5,)
    torch.testing.assert_close(scores.kept_log_mass, want)
    torch.testing.assert_close(scores.logps, P.log())  # the log-probs stay over the whole vocabulary
    assert token_logps_and_entropy(z, torch.arange(5)).kept_log_mass is None


def test_renormalised_weights_by_hand():
    """top_p=0.7. pi_old = P keeps (0.4, 0.25, 0.2), mass S_old = 0.85; the sampler's q = (0.42, 0.22,
    0.2, 0.1, 0.06) keeps (0.42, 0.22, 0.2), mass 0.84, and draws tokens 0, 2, 1 recording log(q / 0.84):
    0.5, 0.238095, 0.261905. On the support, rho = (p / 0.85) / (q / 0.84) = 0.470588 / 0.5, 0.235294 /
    0.238095, 0.294118 / 0.261905 = 0.941176, 0.988235, 1.122995 (sequence: 1.044502): the
    sampler / trainer mismatch alone. Over the whole vocabulary rho = p / (q / 0.84) = 0.8, 0.84,
    0.954545: each S_old = 0.85 times that, the sequence 0.85^3 = 0.614 times it, 0.641455."""
    drawn = torch.tensor([0, 2, 1])
    q = torch.tensor([0.42, 0.22, 0.2, 0.1, 0.06])
    inputs = {"sampler_logps": (q[drawn] / 0.84).log().unsqueeze(0)}  # (1, 3)
    old, _, kept = token_logps_and_entropy(P.log().expand(3, 5), drawn, truncation=Truncation(top_p=0.7))
    old, kept, mask = old.unsqueeze(0), kept.unsqueeze(0), torch.ones(1, 3)  # (1, 3) each
    token, sequence = SamplerCorrection("token_truncate", None, 10.0), SamplerCorrection("sequence_truncate")
    renormalised = on_policy_support(inputs, kept)["sampler_logps"]
    torch.testing.assert_close(
        sampler_is_weights(old, renormalised, mask, token), torch.tensor([[0.941176, 0.988235, 1.122995]])
    )
    torch.testing.assert_close(
        sampler_is_weights(old, renormalised, mask, sequence), torch.full((1, 3), 1.044502)
    )
    whole = inputs["sampler_logps"]
    torch.testing.assert_close(
        sampler_is_weights(old, whole, mask, token), torch.tensor([[0.8, 0.84, 0.954545]])
    )
    torch.testing.assert_close(sampler_is_weights(old, whole, mask, sequence), torch.full((1, 3), 0.641455))
    assert on_policy_support(inputs, None) is inputs and on_policy_support({}, kept) == {}


def test_the_truncation_replayed_is_the_one_generation_applies(tmp_path):
    """Fields and generation_kwargs (which win) as generation reads them, vLLM's order with vLLM, None
    when nothing cuts or renormalize_truncated_sampling is off."""
    args = config(tmp_path, top_k=20, top_p=0.9, generation_kwargs={"top_p": 0.8, "min_p": 0.05})
    assert args.loss_settings().sampler_truncation == Truncation(20, 0.8, 0.05, min_p_first=False)
    vllm = with_vllm(config(tmp_path, min_p=0.1))
    assert vllm.loss_settings().sampler_truncation == Truncation(min_p=0.1, min_p_first=True)
    assert config(tmp_path, generation_kwargs={"top_k": -1}).loss_settings().sampler_truncation is None
    off = config(tmp_path, top_p=0.9, renormalize_truncated_sampling=False)
    assert off.loss_settings().sampler_truncation is None


@pytest.mark.parametrize(
    "settings",
    [{"num_iterations": 1}, {"num_iterations": 2}, {"num_iterations": 2, "token_budget": 1}],
    ids=["pi_old-this-pass", "pi_old-pass", "pi_old-token-budget-passes"],
)
def test_our_decoder_under_top_p_gets_weights_of_one(tmp_path, settings):
    """Our decoder samples from the float32 policy itself, so on the truncated support pi_old / pi_sampler
    is 1 up to rounding, whether pi_old comes from the loss's own pass or the no-grad pass before it
    (num_iterations=2), one pass per micro-batch or a round's passes cut by token_budget (a row each).
    Over the whole vocabulary (renormalize_truncated_sampling=False) each weight is
    the mass top_p=0.7 kept of a tiny model's flat distribution: well below 1."""
    means = {}
    for renormalize in (True, False):
        trainer = GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(
                tmp_path / str(renormalize),
                max_steps=1,
                top_p=0.7,
                sampler_is_cap=10.0,
                renormalize_truncated_sampling=renormalize,
                **settings,
            ),  # fmt: skip
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
        )
        trainer.train()
        logged = trainer.state.log_history[0]
        means[renormalize] = logged["sampling/importance_sampling_ratio/mean"]
        assert logged["sampler/ratio_mean"] == pytest.approx(means[renormalize], rel=1e-5)
    assert means[True] == pytest.approx(1.0, abs=1e-4)
    assert means[False] < 0.9
