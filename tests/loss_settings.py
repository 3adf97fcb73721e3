"""`grpo_loss` with settings named as `GRPOConfig` names them: the tests' way to say "a run with
epsilon=0.3". The defaults are a default `GRPOConfig`'s (`GRPOConfig.loss_settings()`), so they stay
declared once, in the config."""

import dataclasses
import functools

import torch

from grpo_hf.algorithm.loss import LossSettings, grpo_loss
from grpo_hf.algorithm.policy_terms import PolicySettings
from grpo_hf.config import GRPOConfig

# grpo_loss's keywords that are not settings: tensors, and the current values of adaptive settings.
RUNTIME = {
    "beta", "entropy", "entropy_coef", "dapo_normalizer", "entropy_normalizer", "sampler_weights",
    "off_policy_mask", "entropy_mask",
}  # fmt: skip


POLICY_FIELDS = {field.name for field in dataclasses.fields(PolicySettings)}


@functools.cache
def default_settings() -> LossSettings:
    """A default GRPOConfig's loss settings, max_completion_length None (the tensors' width)."""
    config = GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False)
    return dataclasses.replace(config.loss_settings(), max_completion_length=None)


def loss_settings(**overrides) -> LossSettings:
    """The default settings with `overrides` by GRPOConfig's names, unchecked (the loss is what is
    tested); epsilon_high None follows epsilon, as in the config."""
    policy = {name: overrides.pop(name) for name in list(overrides) if name in POLICY_FIELDS}
    settings = default_settings()
    if policy.get("epsilon_high") is None and {"epsilon", "epsilon_high"} & policy.keys():
        policy["epsilon_high"] = policy.get("epsilon", settings.policy.epsilon)
    policy = dataclasses.replace(settings.policy, **policy)
    return dataclasses.replace(settings, policy=policy, **overrides)


def grpo_loss_with(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    **keywords,
) -> tuple[torch.Tensor, dict]:
    """grpo_loss with the settings among `keywords` (GRPOConfig's names) and its other keywords."""
    runtime = {name: keywords.pop(name) for name in list(keywords) if name in RUNTIME}
    settings = loss_settings(**keywords)
    return grpo_loss(logps, old_logps, ref_logps, advantages, completion_mask, settings, **runtime)
