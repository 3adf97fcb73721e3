"""grpo-hf: a GRPO trainer for the Hugging Face stack (Trainer-style API, Accelerate, PEFT)."""

from grpo_hf.config.async_grpo_config import AsyncGRPOConfig
from grpo_hf.config.grpo_config import GRPOConfig
from grpo_hf.script_args import DatasetConfig, DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from grpo_hf.script_utils import (
    get_dataset,
    get_kbit_device_map,
    get_peft_config,
    get_quantization_config,
    init_zero_verbose,
)
from grpo_hf.trainer import AsyncGRPOTrainer, GRPOTrainer

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "DatasetConfig",
    "DatasetMixtureConfig",
    "GRPOConfig",
    "GRPOTrainer",
    "ModelConfig",
    "ScriptArguments",
    "TrlParser",
    "get_dataset",
    "get_kbit_device_map",
    "get_peft_config",
    "get_quantization_config",
    "init_zero_verbose",
]
__version__ = "0.1.0"
