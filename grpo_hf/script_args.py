"""What a training script reads from its command line and YAML file, under TRL 1.16's names.

TRL's example scripts parse `TrlParser((ScriptArguments, GRPOConfig, ModelConfig))` (plus
`DatasetMixtureConfig` in `trl/scripts/grpo.py`) and build the trainer from the result; these are
the same classes with the same fields, defaults and meaning, so such a script runs on grpo-hf with
its import line changed. `grpo_hf.script_utils` turns them into a `LoraConfig`, a
`BitsAndBytesConfig` and a dataset.

`TrlParser` is `HfArgumentParser` with `--config file.yaml`: the file's values become the defaults,
flags on the command line override them, and its `env:` mapping is put into `os.environ` before
anything is parsed. Departures from TRL, each an earlier or clearer error: `ModelConfig` rejects a
`dtype` or `bnb_4bit_quant_type` outside its choices also when it comes from YAML or Python (argparse
checks only the command line), `DatasetConfig` keys are checked when a mixture is built, unknown
keys in the YAML file are reported before the command line is parsed, and `--config=path` is read
like `--config path`. One setting TRL lacks: `DatasetMixtureConfig.test_split_seed` seeds
`get_dataset`'s test split (TRL's draws from NumPy's global random state, another split on every
process and every run).
"""

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import yaml
from transformers import HfArgumentParser


@dataclass
class ScriptArguments:
    """Arguments every TRL-style script takes: which dataset and splits to train and evaluate on."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Dataset to load: a Hub id, a local folder, or a builder name such as 'json' (then give "
            "data files through `datasets` instead). Ignored when `datasets` is given."
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


class TrlParser(HfArgumentParser):
    """`HfArgumentParser` that also reads `--config file.yaml` (see the module docstring).

        parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
        script_args, training_args, model_args = parser.parse_args_and_config()

    A field named `config` is refused: `--config` is the file.
    """

    def __init__(self, dataclass_types=None, **kwargs):
        if dataclass_types is None:
            dataclass_types = []
        elif dataclasses.is_dataclass(dataclass_types) or not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        dataclass_types = list(dataclass_types)  # a generator would be spent by the check below
        for dataclass_type in dataclass_types:
            if "config" in {f.name for f in dataclasses.fields(dataclass_type)}:
                raise ValueError(
                    f"{dataclass_type.__name__} has a field named 'config', which TrlParser reserves for the "
                    "--config file; rename the field."
                )
        super().__init__(dataclass_types=dataclass_types, **kwargs)

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ) -> tuple:
        """One instance per dataclass: the YAML file's values, overridden by the command line.

        `args` defaults to `sys.argv[1:]`. Keys of the file that no dataclass has are an error with
        `fail_with_unknown_args`; with `return_remaining_strings` they come back as
        `['--key', 'value', ...]` after the dataclasses, joined with the command line's leftovers, or
        as two lists (file's, command line's) with `separate_remaining_strings`.
        """
        args = list(sys.argv[1:] if args is None else args)
        config_path, args = _pop_config_flag(args)
        from_file = self.set_defaults_with_config(**read_config(config_path)) if config_path else []
        if from_file and fail_with_unknown_args and not return_remaining_strings:
            raise ValueError(
                f"Unknown settings in {config_path}: {from_file[::2]}; remove them, or parse with "
                "fail_with_unknown_args=False."
            )
        output = self.parse_args_into_dataclasses(
            args=args, return_remaining_strings=return_remaining_strings
        )
        if not return_remaining_strings:
            return output
        *parsed, from_command_line = output
        if separate_remaining_strings:
            return (*parsed, from_file, from_command_line)
        return (*parsed, from_file + from_command_line)

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        """Make `kwargs` the defaults of the arguments they name (also in subparsers), no longer
        required; returns the others as `['--key', 'value', ...]`."""
        used = _apply_defaults(self, kwargs)
        return [item for key, value in kwargs.items() if key not in used for item in (f"--{key}", str(value))]


def read_config(path: str) -> dict:
    """A `--config` YAML file as a mapping, after putting its `env:` mapping into `os.environ`."""
    with open(path) as file:
        config = yaml.safe_load(file)
    if not isinstance(config, dict):
        raise ValueError(f"Config file {path} must contain a YAML mapping (setting: value lines).")
    env = config.pop("env", {})
    if not isinstance(env, dict):
        raise ValueError(f"`env` in {path} must be a mapping of environment variables to values.")
    for name, value in env.items():
        os.environ[name] = str(value)
    return config


def _pop_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    """The `--config` path (`--config path` or `--config=path`) and the arguments without it."""
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1], args[:i] + args[i + 1 :]
        if arg == "--config":
            if i + 1 == len(args):
                raise ValueError("--config needs the path of a YAML file.")
            return args[i + 1], args[:i] + args[i + 2 :]
    return None, args


def _apply_defaults(parser: argparse.ArgumentParser, values: dict) -> set[str]:
    used = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                used |= _apply_defaults(subparser, values)
        elif action.dest in values:
            action.default, action.required = values[action.dest], False
            used.add(action.dest)
    return used
