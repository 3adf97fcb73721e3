"""`GRPOConfig` (a `transformers.TrainingArguments`) in sections, each with its own checks:
`rollout_args` (data, sampling, batch geometry, rewards, dynamic sampling, tools), `loss_args`
(policy term, importance sampling, KL), `generation_args` (transformers' generate), `vllm_args`
(vLLM), `async_args` (async GRPO); `checks` holds the checks they share; `reporting` checks that each
integration in report_to can start; `grpo_config` joins them and checks across sections."""

from grpo_hf.config.grpo_config import GENERATION_BACKENDS, PRECISIONS, GRPOConfig, default_output_dir

__all__ = ["GENERATION_BACKENDS", "PRECISIONS", "GRPOConfig", "default_output_dir"]
