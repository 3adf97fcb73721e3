"""`grpo_hf.loss`, kept for readers of the maths: the module is `grpo_hf.algorithm.loss`."""

from grpo_hf.algorithm.loss import *  # noqa: F403
