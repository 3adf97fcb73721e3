"""The loss settings of `GRPOConfig`: the policy term (clipping, loss_type and its variants' knobs,
masks, entropy bonus), the importance-sampling correction against the sampler, and the KL to the
reference. Names and meanings are TRL 1.16's where TRL has the setting (`policy_terms`, `loss`,
`masks`, `sampler_correction`, `entropy_control` and `reference` implement them).

`GRPOConfig` inherits these fields and calls `_resolve_loss_settings` and `_check_loss_settings` in
its `__post_init__`; the checks that also read the generation backend (`check_loss_combinations`)
are `GRPOConfig`'s own, with `check_sampler_settings` and `loss_type_warnings` below.
`loss_settings()` hands the loss what it takes, typed (`algorithm.loss.LossSettings`).
"""

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from grpo_hf.algorithm.loss import LossSettings
from grpo_hf.algorithm.policy_terms import CLIPPED_LOSS_TYPES, POLICY_TERMS, PolicySettings
from grpo_hf.algorithm.sampler_correction import IS_MODES, SamplerCorrection
from grpo_hf.config.checks import check_choices, check_ranges

LOSS_TYPES = tuple(POLICY_TERMS)
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass
class LossArguments:
    """How the loss is computed from a generation round (see the module docstring)."""

    _help_section: ClassVar[tuple[str, str]] = ("loss", "GRPO, loss: policy term, importance sampling, KL")

    # ---- Policy loss ---------------------------------------------------------------------------
    num_iterations: int = field(
        default=1, metadata={"help": "Passes over each generation round (mu in DeepSeekMath)."}
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range: ratio >= 1 - epsilon."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clip range (DAPO clip-higher, e.g. 0.28); default epsilon."}
    )
    delta: float | None = field(
        default=None,
        metadata={"help": "Cap on the unclipped ratio for negative advantages (two-sided clip), e.g. 4.0."},
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "The loss (grpo_hf/policy_terms.py). Clipped surrogate, aggregated as: 'grpo' (per-sequence "
            "mean), 'bnpo' (micro-batch token mean), 'dr_grpo' (sum / (B * max_completion_length)), 'dapo' (token "
            "mean over all the tokens, on every process, that feed one optimizer step), 'luspo' (per-sequence sum, "
            "then mean; LUSPO, with importance_sampling_level='sequence'). Other policy terms: 'cispo' (clipped, "
            "detached importance weight times log-prob, MiniMax-M1; dapo's mean), 'sapo' (soft sigmoid gate, "
            "SAPO; grpo's mean), 'vespo' (Gamma-shaped sequence weight, VESPO; dapo's mean)."
        },
    )
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "SAPO gate temperature for tokens with advantage <= 0."}
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "SAPO gate temperature for tokens with advantage > 0."}
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata={
            "help": "VESPO power k for advantages >= 0: how hard sequences with ratio < 1 are down-weighted."
        },
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata={
            "help": "VESPO decay lambda for advantages >= 0: how hard sequences with ratio > 1 are down-weighted."
        },
    )
    vespo_k_neg: float = field(default=3.0, metadata={"help": "VESPO power k for advantages < 0."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "VESPO decay lambda for advantages < 0."})
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "'token' ratios (GRPO) or one ratio per sequence (GSPO, arXiv 2507.18071)."},
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2's delta, e.g. 0.5): a sequence with a negative "
            "advantage whose mean log(pi_sampler / pi) over its tokens exceeds this leaves the policy term. None: off."
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Keep the policy term (and the entropy bonus) only on the top fraction of loss tokens by "
            "entropy, quantile over the micro-batch on every process (arXiv 2506.01939 recommends 0.2); 1.0 keeps "
            "all, 0.0 only the highest."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus (arXiv 2504.20571): loss -= coef * the mean token entropy (over the optimizer "
            "step's loss tokens on every process), for every loss_type alike; negative, an entropy penalty (as "
            "in TRL, which does not restrict the sign). The starting value with use_adaptive_entropy (then >= 0)."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Adaptive entropy coefficient (Skywork-OR1, arXiv 2505.22312): after each optimizer step "
            "entropy_coef moves up by entropy_coef_delta if the step's entropy was <= entropy_target, else down; "
            "the bonus applies only while the entropy is <= entropy_target."
        },
    )
    entropy_coef_min: float = field(
        default=0.0, metadata={"help": "Lower bound of the adaptive entropy_coef."}
    )
    entropy_coef_max: float = field(
        default=1.0, metadata={"help": "Upper bound of the adaptive entropy_coef."}
    )
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "Step of the adaptive entropy_coef per optimizer step."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={
            "help": "Target mean token entropy (nats) of the adaptive entropy_coef, over the tokens the bonus acts "
            "on. 0.2 engages only near collapse; set it near the 'entropy' logged early in training."
        },
    )

    # ---- Importance sampling against the sampler (grpo_hf/sampler_correction.py) ----------------
    sampler_is_cap: float | None = field(
        default=None,
        metadata={
            "help": "Our decoder: truncated importance sampling (token level), weighting each token's policy term "
            "by min(pi_old / pi_sampler, cap), correcting for the sampler (bf16 copy, top_p ...) drawing from "
            "another distribution than the policy's; e.g. 2.0. Off by default. With vLLM use "
            "vllm_importance_sampling_*. The mismatch is logged either way ('sampler/*', 'sampling/*')."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "When vLLM generates: weight the policy term by the importance ratio pi_old / pi_vllm, bounded "
            "as vllm_importance_sampling_mode says."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "'token_truncate' / 'sequence_truncate': the token's / sequence's ratio clipped to "
            "[clip_min, clip_max]; 'token_mask' / 'sequence_mask': set to 0 outside it."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound C_max of the vLLM importance ratio; None: none."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound C_min of the vLLM importance ratio; None: none."}
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Deprecated (as in TRL): use vllm_importance_sampling_clip_max."}
    )
    renormalize_truncated_sampling: bool = field(
        default=True,
        metadata={
            "help": "Under top_k / top_p / min_p, compare the sampler's log-probs (those of the truncated "
            "distribution it drew from) with the trainer's renormalised over the tokens the truncation keeps, "
            "replayed on the trainer's distribution: the importance weights, off_policy_mask_threshold and the "
            "'sampler/*', 'sampling/*' metrics see the sampler / trainer mismatch alone (TRL 1.17's behaviour). "
            "False: over the whole vocabulary, so each token's weight also carries the mass the truncation kept, "
            "multiplied over a completion's tokens by the sequence modes (grpo-hf before 1.17's)."
        },
    )

    # ---- KL to the reference -------------------------------------------------------------------
    beta: float = field(
        default=0.0,
        metadata={
            "help": "KL coefficient. 0 (TRL's default) loads no reference model; DeepSeekMath used 0.04, "
            "DeepSeek-R1 0.001."
        },
    )
    kl_estimator: str = field(
        default="k3", metadata={"help": "KL estimator: 'k1', 'k2' or 'k3' (Schulman's approximations)."}
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Weight the KL term by the importance ratio pi / pi_old (differentiable), making its gradient "
            "the unbiased gradient of KL(pi || pi_ref) (DeepSeek-V3.2, arXiv 2512.02556); changes the gradient even "
            "at ratio 1."
        },
    )
    target_kl: float | None = field(
        default=None,
        metadata={
            "help": "Adaptive KL: beta follows a proportional controller towards this KL (arXiv 1909.08593)."
        },
    )
    kl_horizon: int = field(
        default=10000, metadata={"help": "Adaptive KL horizon, in completions (10000 in arXiv 1909.08593)."}
    )
    sync_ref_model: bool = field(
        default=False, metadata={"help": "Move the reference towards the policy every ref_model_sync_steps."}
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "Reference update: ref = alpha * policy + (1 - alpha) * ref."}
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "Optimizer steps between reference updates."}
    )

    def loss_settings(self) -> LossSettings:
        """The loss's settings, typed, as `grpo_loss` and `masks.policy_weights` take them."""
        policy = PolicySettings(
            self.epsilon, self.epsilon_high, self.delta, self.sapo_temperature_neg, self.sapo_temperature_pos,
            self.vespo_k_pos, self.vespo_lambda_pos, self.vespo_k_neg, self.vespo_lambda_neg,
        )  # fmt: skip
        return LossSettings(
            loss_type=self.loss_type,
            policy=policy,
            kl_estimator=self.kl_estimator,
            use_bias_correction_kl=self.use_bias_correction_kl,
            importance_sampling_level=self.importance_sampling_level,
            max_completion_length=self.max_completion_length,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            top_entropy_quantile=self.top_entropy_quantile,
            sampler_correction=sampler_correction(self),
            sampler_truncation=self.sampler_truncation() if self.renormalize_truncated_sampling else None,
        )

    def _resolve_loss_settings(self) -> None:
        """epsilon_high defaults to epsilon; the deprecated vllm_importance_sampling_cap sets clip_max."""
        self.epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated (as in TRL); use vllm_importance_sampling_clip_max.",
                FutureWarning,
                stacklevel=4,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap

    def _check_loss_settings(self) -> None:
        """Each loss setting among its allowed values and within its range."""
        check_choices(
            self,
            (
                ("loss_type", LOSS_TYPES),
                ("kl_estimator", KL_ESTIMATORS),
                ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
                ("vllm_importance_sampling_mode", IS_MODES),
            ),
        )
        checks = [
            (self.num_iterations >= 1, "num_iterations must be >= 1"),
            (self.epsilon > 0, "epsilon must be > 0"),
            (self.epsilon_high > 0, "epsilon_high must be > 0"),
            (
                self.delta is None
                or self.loss_type not in CLIPPED_LOSS_TYPES
                or self.delta > 1 + self.epsilon_high,
                "delta must be > 1 + epsilon_high",
            ),
            (self.sapo_temperature_neg > 0, "sapo_temperature_neg must be > 0"),
            (self.sapo_temperature_pos > 0, "sapo_temperature_pos must be > 0"),
            (min(self.vespo_k_pos, self.vespo_k_neg) >= 0, "vespo_k_pos and vespo_k_neg must be >= 0"),
            (
                min(self.vespo_lambda_pos, self.vespo_lambda_neg) > 0,
                "vespo_lambda_pos and vespo_lambda_neg must be > 0",
            ),
            (self.beta >= 0, "beta must be >= 0 (0 disables the KL term)"),
            (
                self.entropy_coef >= 0 or not self.use_adaptive_entropy,
                "entropy_coef must be >= 0 with use_adaptive_entropy (it starts the adaptive coefficient, "
                "kept within [entropy_coef_min, entropy_coef_max])",
            ),
            (
                0 <= self.top_entropy_quantile <= 1,
                "top_entropy_quantile must be in [0, 1] (1 keeps every token)",
            ),
            (self.entropy_coef_min >= 0, "entropy_coef_min must be >= 0"),
            (self.entropy_coef_max >= self.entropy_coef_min, "entropy_coef_max must be >= entropy_coef_min"),
            (self.entropy_coef_delta > 0, "entropy_coef_delta must be > 0"),
            (self.entropy_target >= 0, "entropy_target must be >= 0 (nats)"),
            (
                self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
                "off_policy_mask_threshold must be >= 0 (a divergence; None turns the mask off)",
            ),
            (self.sampler_is_cap is None or self.sampler_is_cap > 0, "sampler_is_cap must be > 0"),
            (
                self.vllm_importance_sampling_clip_max is None or self.vllm_importance_sampling_clip_max > 0,
                "vllm_importance_sampling_clip_max must be > 0 (or None: no upper bound)",
            ),
            (
                self.vllm_importance_sampling_clip_min is None or self.vllm_importance_sampling_clip_min >= 0,
                "vllm_importance_sampling_clip_min must be >= 0 (or None: no lower bound)",
            ),
            (self.target_kl is None or self.target_kl > 0, "target_kl must be > 0"),
            (self.target_kl is None or self.beta > 0, "target_kl needs beta > 0 as the controller's start"),
            (self.kl_horizon >= 1, "kl_horizon must be >= 1"),
            (0 <= self.ref_model_mixup_alpha <= 1, "ref_model_mixup_alpha must be in [0, 1]"),
            (self.ref_model_sync_steps >= 1, "ref_model_sync_steps must be >= 1"),
            (not (self.sync_ref_model and self.beta == 0), "sync_ref_model needs beta > 0 (a reference)"),
        ]
        check_ranges(checks)


def loss_type_warnings(args) -> list[str]:
    """Warnings for a `GRPOConfig`'s loss settings that do not fit together: TRL's three, and ours
    for a CISPO cap below 1 and a `delta` that has no effect."""
    level, loss_type = args.importance_sampling_level, args.loss_type
    found = []
    if level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        found.append(
            f"With importance_sampling_level='sequence', the '{loss_type}' loss sums per-token contributions, "
            "which weights each sequence by its completion length instead of optimizing the per-sequence "
            "objective. To reproduce the GSPO paper's setup, set loss_type='grpo'."
        )
    if loss_type == "luspo" and level != "sequence":
        found.append(
            "loss_type='luspo' is meant for importance_sampling_level='sequence' (the LUSPO paper's)."
        )
    if loss_type == "vespo" and level != "token":
        found.append(
            "loss_type='vespo' takes the sequence's importance weight itself; importance_sampling_level "
            "should be 'token' (the default)."
        )
    if loss_type == "cispo" and args.epsilon_high < 1:
        found.append(
            f"loss_type='cispo' caps the importance ratio at epsilon_high itself, not 1 + epsilon_high: "
            f"{args.epsilon_high} < 1 scales every on-policy token's gradient down to it. ScaleRL uses 4 to 5."
        )
    if args.delta is not None and loss_type not in CLIPPED_LOSS_TYPES:
        found.append(f"delta has no effect with loss_type={loss_type!r} (only with {CLIPPED_LOSS_TYPES}).")
    return found


def vllm_generates(args) -> bool:
    """Whether vLLM makes the completions (after `GRPOConfig.__post_init__`)."""
    return args.generation_backend == "vllm"


def check_sampler_settings(args) -> None:
    """Errors for a `GRPOConfig`'s importance-sampling settings that contradict each other (TRL's
    checks, and ours for sampler_is_cap with vLLM)."""
    clip_min, clip_max = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    mode = args.vllm_importance_sampling_mode
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(
            f"vllm_importance_sampling_clip_min ({clip_min}) must be less than "
            f"vllm_importance_sampling_clip_max ({clip_max})."
        )
    if (
        args.vllm_importance_sampling_correction
        and mode.endswith("truncate")
        and clip_min is None
        and clip_max is None
    ):
        raise ValueError(
            "Set vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max (or both) for "
            f"vllm_importance_sampling_mode={mode!r}."
        )
    if vllm_generates(args) and args.sampler_is_cap is not None:
        raise ValueError(
            "sampler_is_cap corrects our own decoder; with vLLM set vllm_importance_sampling_mode and "
            "vllm_importance_sampling_clip_max instead, and sampler_is_cap=None."
        )
    correcting = vllm_generates(args) and args.vllm_importance_sampling_correction
    if args.loss_type == "vespo" and correcting and not mode.startswith("token"):
        raise ValueError(
            "loss_type='vespo' needs token-level importance weights: set vllm_importance_sampling_mode to "
            f"'token_truncate' or 'token_mask' (got {mode!r})."
        )


def sampler_correction(args) -> SamplerCorrection | None:
    """The correction `GRPOConfig` asks for the backend that generates, or None."""
    if vllm_generates(args):
        if not args.vllm_importance_sampling_correction:
            return None
        return SamplerCorrection(
            args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_min,
            args.vllm_importance_sampling_clip_max,
        )
    if args.sampler_is_cap is None:
        return None
    return SamplerCorrection("token_truncate", None, args.sampler_is_cap)
