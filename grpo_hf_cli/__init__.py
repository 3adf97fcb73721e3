"""grpo-hf's command line: `grpo-hf grpo ...` and `grpo-hf env`, as TRL 1.16's `trl grpo` and `trl env`.

- `grpo`: the GRPO script (`grpo_hf_cli.grpo`): TRL's `trl grpo` arguments with their meaning (a
  dataset by `--dataset_name` or a `datasets:` mixture, `--reward_funcs`, `--reward_model_name_or_path`,
  `ModelConfig`'s LoRA and quantization flags, every `GRPOConfig` setting), and grpo-hf's built-in
  tasks (`--task`) with their held-out accuracy before and after training. `recipes/grpo.py` is the
  same script, for `accelerate launch`.
- `launch`: how `grpo-hf grpo` starts it: through `accelerate launch`, as `trl grpo` does.
- `rewards`: reward functions by name; `task_report`: the built-in tasks' evaluation and report;
  `env`: what a bug report needs.

A package beside `grpo_hf`, not inside it: it builds a `GRPOTrainer`, and in grpo_hf's layering
only the package's face (`grpo_hf/__init__.py`) imports the trainer. Nothing in `grpo_hf` imports it.
"""
