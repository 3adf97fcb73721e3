"""grpo-hf: a GRPO trainer for the Hugging Face stack (Trainer-style API, Accelerate, PEFT)."""

from grpo_hf.config import GRPOConfig
from grpo_hf.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
__version__ = "0.1.0"
