"""The maths of GRPO as pure tensor functions: group advantages (`advantages`), the loss
(`loss`, with the policy terms of each loss type in `policy_terms`), the off-policy and
high-entropy token masks (`masks`) and importance sampling against the sampler
(`sampler_correction`). Nothing here imports a model, a config or the trainer: torch only."""
