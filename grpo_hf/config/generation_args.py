"""The generation-backend settings of `GRPOConfig`: transformers' generate and continuous batching,
and `generation_kwargs` (vLLM's own settings are `vllm_args`). TRL 1.16's names and meanings;
grpo-hf's own additions are marked "(grpo-hf)" in their help.

`GRPOConfig` inherits these fields and calls `check_generation_settings` in its `__post_init__`.
After it, vLLM generates exactly when `generation_backend == "vllm"` (`use_vllm=True` sets it).
"""

import logging
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from transformers import GenerationConfig

from grpo_hf.algorithm.sampler_correction import Truncation
from grpo_hf.config.checks import check_dicts
from grpo_hf.engine.generation import GenerationSettings, Sampling

logger = logging.getLogger(__name__)


@dataclass
class GenerationBackendArguments:
    """Which engine samples the completions, and its settings (see the module docstring)."""

    _help_section: ClassVar[tuple[str, str]] = (
        "generation",
        "GRPO, generation: sampling settings passed through, transformers' generate",
    )

    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "More sampling settings, overriding the ones above where they clash: GenerationConfig "
            "keys for our decoder and transformers (e.g. no_repeat_ngram_size, suppress_tokens, num_beams; keys "
            "our decoder does not implement switch to transformers' generate), with vLLM the SamplingParams "
            "keys its server also takes, in both modes (e.g. presence_penalty, stop, min_tokens)."
        },
    )
    cache_implementation: str | None = field(
        default=None,
        metadata={
            "help": "KV-cache implementation for generation without vLLM (e.g. 'static'); when set, "
            "transformers' generate samples (with that cache) instead of our decoder."
        },
    )
    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={"help": "Sample with transformers' continuous batching engine (model.generate_batch)."},
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of transformers.ContinuousBatchingConfig (max_memory_percent defaults "
            "to 0.5 here, leaving memory for training)."
        },
    )
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "Deprecated: use use_transformers_continuous_batching."}
    )

    def check_generation_settings(self) -> None:
        """Resolve use_vllm / generation_backend and check every generation setting (no model, no vLLM import)."""
        if self.use_transformers_paged:
            warnings.warn(
                "use_transformers_paged is deprecated: use use_transformers_continuous_batching.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching = True
        if self.use_vllm or self.generation_backend == "vllm":
            self.use_vllm, self.generation_backend = True, "vllm"
        check_dicts(
            self, ("generation_kwargs", "transformers_continuous_batching_config", "vllm_engine_kwargs")
        )
        self.generation_kwargs = dict(self.generation_kwargs or {})
        if self.use_vllm:
            self._check_vllm()
        else:
            self._check_transformers_generation()
        self._warn_truncated_sampling()

    def _check_transformers_generation(self) -> None:
        unknown = sorted(set(self.generation_kwargs) - set(GenerationConfig().to_dict()))
        if unknown:
            raise ValueError(
                f"generation_kwargs: {unknown} are not GenerationConfig settings (without vLLM, generation_kwargs "
                "are transformers.GenerationConfig keys); remove them."
            )
        if self.generation_kwargs.get("num_return_sequences", 1) != 1:
            raise ValueError(
                "generation_kwargs: num_return_sequences must be 1 (each prompt is already repeated "
                "num_generations times); set num_generations instead."
            )
        if self.vllm_enable_sleep_mode or self.vllm_structured_outputs_regex is not None:
            logger.warning(
                "vllm_enable_sleep_mode / vllm_structured_outputs_regex apply with use_vllm=True only."
            )

    def sampler_truncation(self) -> Truncation | None:
        """What top_k / top_p / min_p (as set, or in generation_kwargs, which win) cut from each token's
        distribution, in the order the generating backend applies them; None when none of them cuts."""
        knobs = {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}
        knobs |= {name: value for name, value in self.generation_kwargs.items() if name in knobs}
        truncation = Truncation(
            top_k=max(knobs["top_k"] or 0, 0),  # vLLM's -1 is off too
            top_p=1.0 if knobs["top_p"] is None else knobs["top_p"],
            min_p=knobs["min_p"] or 0.0,
            min_p_first=self.generation_backend == "vllm",
        )
        return None if truncation == Truncation(min_p_first=truncation.min_p_first) else truncation

    def _warn_truncated_sampling(self) -> None:
        """With renormalize_truncated_sampling off, the truncation's kept mass enters the importance weights."""
        truncation = self.sampler_truncation()
        if truncation is not None and not self.renormalize_truncated_sampling:
            cut = [
                k
                for k, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
                if getattr(truncation, k) != off
            ]
            logger.warning(
                f"{' / '.join(cut)} truncate the sampling distribution, and renormalize_truncated_sampling=False "
                "compares the sampler's log-probs (those of the truncated distribution it drew from) with the "
                "policy's over the whole vocabulary: on each token pi_old / pi_sampler is the probability mass the "
                "truncation kept (<= 1) times the sampler / trainer mismatch, the sequence modes of "
                "vllm_importance_sampling_mode multiply it over a completion's tokens, and off_policy_mask_threshold "
                "and sampler/ratio_* count it. Leave renormalize_truncated_sampling=True (TRL 1.17's behaviour) "
                "unless you mean this."
            )

    def sampling(self, eos_token_ids: list[int], pad_token_id: int) -> Sampling:
        """What each generation call samples (cache_implementation joins the GenerationConfig keys)."""
        extra = dict(self.generation_kwargs)
        if self.cache_implementation is not None:
            extra["cache_implementation"] = self.cache_implementation
        return Sampling(
            max_new_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
            generation_kwargs=extra,
            seed=self.seed,
        )

    def generation_settings(self) -> GenerationSettings:
        """What the engine takes of these settings, typed (`engine.generation.GenerationSettings`)."""
        return GenerationSettings(
            generation_backend=self.generation_backend,
            generation_dtype=self.generation_dtype,
            rollout_quantization=self.rollout_quantization,
            bf16=bool(self.bf16),
            cache_implementation=self.cache_implementation,
            generation_kwargs=dict(self.generation_kwargs),
            use_transformers_continuous_batching=self.use_transformers_continuous_batching,
            transformers_continuous_batching_config=self.transformers_continuous_batching_config,
            ds3_gather_for_generation=self.ds3_gather_for_generation,
            seed=self.seed,
            vllm=self.vllm_settings() if self.generation_backend == "vllm" else None,
        )
