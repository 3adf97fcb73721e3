"""`grpo_hf.sharding`, kept as documented: the module is `grpo_hf.models.sharding`."""

from grpo_hf.models.sharding import *  # noqa: F403
