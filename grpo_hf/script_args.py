"""What a training script reads from its command line and YAML file, under TRL 1.16's names.

TRL's example scripts parse `TrlParser((ScriptArguments, GRPOConfig, ModelConfig))` (plus
`DatasetMixtureConfig` in `trl/scripts/grpo.py`) and build the trainer from the result; these are
the same classes with the same fields, defaults and meaning, so such a script runs on grpo-hf with
its import line changed. `grpo_hf.script_utils` turns them into a `LoraConfig`, a
`BitsAndBytesConfig` and a dataset; `grpo_hf.script_parser.TrlParser` (importable from here too)
reads them from the command line and a `--config` YAML file.

Departures from TRL, each an earlier or clearer error: `ModelConfig` rejects a `dtype` or
`bnb_4bit_quant_type` outside its choices also when it comes from YAML or Python (argparse checks
only the command line), and `DatasetConfig` keys are checked when a mixture is built. One setting
TRL lacks: `DatasetMixtureConfig.test_split_seed` seeds `get_dataset`'s test split (TRL's draws from
NumPy's global random state, another split on every process and every run).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from grpo_hf.script_parser import TrlParser

__all__ = ["DatasetConfig", "DatasetMixtureConfig", "ModelConfig", "ScriptArguments", "TrlParser"]


@dataclass
class ScriptArguments:
    """Arguments every TRL-style script takes: which dataset and splits to train and evaluate on."""

    _help_section: ClassVar[tuple[str, str]] = ("data", "data: the dataset, its splits, a mixture (YAML)")

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Dataset to load: a Hub id, a local folder, or a builder name such as 'json' (then give "
            "data files through `datasets` instead); grpo-hf's script (`load_script_dataset`) also reads a local "
            "JSON / JSONL / CSV / parquet file. Ignored when `datasets` is given."
        },
    )
    dataset_config: str | None = field(
        default=None,
        metadata={
            "help": "Configuration name of the dataset (`name` of `datasets.load_dataset`). Ignored when "
            "`datasets` is given."
        },
    )
    dataset_train_split: str = field(
        default="train",
        metadata={"help": "Split to train on. Ignored when `datasets` is given."},
    )
    dataset_test_split: str = field(
        default="test",
        metadata={"help": "Split to evaluate on. Ignored when `datasets` is given."},
    )
    dataset_streaming: bool = field(
        default=False,
        metadata={
            "help": "Stream the dataset instead of downloading it whole. Ignored when `datasets` is given."
        },
    )
    ignore_bias_buffers: bool = field(
        default=False,
        metadata={
            "help": "Debug setting for DDP: ignore the model's boolean bias / mask buffers, which DDP cannot "
            "broadcast (https://github.com/huggingface/transformers/issues/22482#issuecomment-1595790992)."
        },
    )


DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANT_TYPES = ("fp4", "nf4")


@dataclass
class ModelConfig:
    """The model to train and how to load it: checkpoint, dtype, LoRA, bitsandbytes quantization.

    A one-element `lora_target_modules` becomes that string, as in TRL, so that `--lora_target_modules
    all-linear` or a regular expression reaches PEFT as one pattern (PEFT matches a string against
    the whole module name, a list against name suffixes).
    """

    _help_section: ClassVar[tuple[str, str]] = ("model", "model: checkpoint, dtype, LoRA, quantization")

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Checkpoint to start from: a Hub id or a local folder."}
    )
    model_revision: str = field(
        default="main", metadata={"help": "Revision of the checkpoint: a branch, a tag or a commit id."}
    )
    dtype: str | None = field(
        default="float32",
        metadata={
            "help": "dtype to load the model's weights in; 'auto' keeps the checkpoint's.",
            "choices": list(DTYPES),
        },
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention implementation (e.g. 'sdpa', 'eager', 'flash_attention_2'); None: transformers'."
        },
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Modules LoRA adapts (names, 'all-linear', or one regular expression); None: PEFT's."
        },
    )
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "Parameters (not modules) LoRA adapts, e.g. MoE expert weights."}
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved beside the adapter."}
    )
    lora_task_type: str = field(
        default="CAUSAL_LM", metadata={"help": "PEFT task type ('SEQ_CLS' for a reward model)."}
    )
    use_rslora: bool = field(
        default=False,
        metadata={"help": "Rank-stabilized LoRA: scale the update by alpha / sqrt(r) instead of alpha / r."},
    )
    use_dora: bool = field(
        default=False,
        metadata={
            "help": "DoRA (arXiv 2402.09353): learn each weight's magnitude apart from its LoRA-updated "
            "direction (linear and Conv2D layers; slower than LoRA, merge before inference)."
        },
    )
    load_in_8bit: bool = field(
        default=False, metadata={"help": "Load the base model in 8 bits (bitsandbytes); only with LoRA."}
    )
    load_in_4bit: bool = field(
        default=False, metadata={"help": "Load the base model in 4 bits (bitsandbytes); only with LoRA."}
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit quantization type.", "choices": list(QUANT_TYPES)}
    )
    use_bnb_nested_quant: bool = field(
        default=False,
        metadata={"help": "Quantize the 4-bit quantization constants too (nested quantization)."},
    )
    bnb_4bit_quant_storage: str | None = field(
        default=None, metadata={"help": "dtype the 4-bit weights are stored in (e.g. 'uint8', 'bfloat16')."}
    )

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("load_in_8bit and load_in_4bit are both set; choose one.")
        if self.dtype not in (*DTYPES, None):
            raise ValueError(f"dtype={self.dtype!r}: use one of {list(DTYPES)}.")
        if self.bnb_4bit_quant_type not in QUANT_TYPES:
            raise ValueError(
                f"bnb_4bit_quant_type={self.bnb_4bit_quant_type!r}: use one of {list(QUANT_TYPES)}."
            )
        if isinstance(self.lora_target_modules, list | tuple) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]


@dataclass
class DatasetConfig:
    """One dataset of a mixture: the arguments of `datasets.load_dataset`, and what to keep of it.

    `fraction` is this dataset's share of the mixture; see `grpo_hf.script_utils.get_dataset`.
    """

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None


@dataclass
class DatasetMixtureConfig:
    """Several datasets concatenated into one (`get_dataset`), from a YAML `datasets:` list:

        datasets:
          - path: json
            data_files: math.jsonl
            columns: [prompt, solution]
            fraction: 0.75
          - path: some/hub-dataset
            split: train
        test_split_size: 0.1
        test_split_seed: 0

    On the command line, `--datasets a b` gives datasets by `path` only.
    """

    _help_section: ClassVar[tuple[str, str]] = ScriptArguments._help_section

    datasets: list[DatasetConfig] = field(
        default_factory=list,
        metadata={"help": "Datasets of the mixture (a YAML list of `DatasetConfig` mappings)."},
    )
    streaming: bool = field(
        default=False, metadata={"help": "Stream the datasets instead of loading them whole."}
    )
    test_split_size: float | None = field(
        default=None,
        metadata={
            "help": "Split the mixture into 'train' and 'test' (`test_size` of `Dataset.train_test_split`: a "
            "fraction, or a number of rows if > 1). None: everything is 'train'."
        },
    )
    # Not in TRL (see the module docstring). Not named `seed`: a TRL script parses this class with
    # GRPOConfig, which has a `--seed` already.
    test_split_seed: int = field(
        default=0,
        metadata={
            "help": "Seed of the 'train' / 'test' split, so that every process and every run (a resumed "
            "one included) gets the same split."
        },
    )

    def __post_init__(self):
        keys = {f.name for f in dataclasses.fields(DatasetConfig)}
        for i, dataset in enumerate(self.datasets):
            if isinstance(dataset, dict):
                if unknown := sorted(set(dataset) - keys):
                    raise ValueError(
                        f"datasets[{i}] has unknown keys {unknown}; a dataset takes {sorted(keys)}."
                    )
                if "path" not in dataset:
                    raise ValueError(f"datasets[{i}] has no `path`.")
                self.datasets[i] = DatasetConfig(**dataset)
