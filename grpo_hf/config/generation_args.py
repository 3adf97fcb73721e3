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

    def _warn_truncated_sampling(self) -> None:
        """top_p / top_k / min_p (as set, or in generation_kwargs) truncate what every backend samples from."""
        knobs = {"top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}
        knobs |= {name: value for name, value in self.generation_kwargs.items() if name in knobs}
        cut = [k for k, v in knobs.items() if v is not None and (v < 1 if k == "top_p" else v > 0)]
        if cut:
            logger.warning(
                f"{' / '.join(cut)} truncate the sampling distribution. The sampler's log-probs (grpo-hf's decoder, "
                "vLLM's with logprobs_mode='processed_logprobs') are those of the truncated, renormalised "
                "distribution actually sampled, the policy's are over the whole vocabulary: on each token pi_old / "
                "pi_sampler is the probability mass the truncation kept (<= 1) times the sampler / trainer "
                "mismatch. The importance weights (vllm_importance_sampling_correction, sampler_is_cap) so correct "
                "for the truncation too (the sequence modes multiply it over a completion's tokens), and "
                "off_policy_mask_threshold and sampler/ratio_* count it."
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
