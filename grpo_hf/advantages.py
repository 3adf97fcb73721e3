"""`grpo_hf.advantages`, kept for readers of the maths: the module is `grpo_hf.algorithm.advantages`."""

from grpo_hf.algorithm.advantages import *  # noqa: F403
