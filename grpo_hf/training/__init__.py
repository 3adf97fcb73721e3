"""The training plumbing around the loss: checkpoints and their GRPO state (`checkpoints`), metrics
(`metrics`), completion logs (`completion_logs`), the adaptive entropy coefficient
(`entropy_control`), the MoE router loss (`moe`) and the model card written beside saved weights
(`model_card`)."""
