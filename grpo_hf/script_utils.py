"""What a training script builds from its parsed arguments (`grpo_hf.script_args`), under TRL's names.

`get_peft_config` and `get_quantization_config` turn a `ModelConfig` into the `peft_config` and
`quantization_config` that `GRPOTrainer` takes; `get_dataset` loads a `DatasetMixtureConfig`, and
`load_script_dataset` a `ScriptArguments`' `dataset_name` (TRL's `load_dataset(dataset_name, ...)`,
and a local data file too, which `datasets.load_dataset` would look for on the Hub);
`init_zero_verbose` quiets a script's logging. `get_kbit_device_map` is TRL's up to 1.15 (1.16
dropped it, transformers places a quantized model itself); it stays for scripts written against
those versions (open-r1's among them), which pass it as `device_map`.

Departures from TRL 1.16, each a clearer error where TRL's fails later or obscurely: `dtype='auto'`
with 4-bit loading asks for an explicit compute dtype (TRL's raises `AttributeError: torch has no
attribute 'auto'`), fractions of a mixture must be >= 0 and not all 0, and a streamed mixture
cannot have a `test_split_size` (TRL's fails on `IterableDataset.train_test_split`).
"""

import logging
import warnings
from pathlib import Path

import datasets
import torch
from accelerate import PartialState
from peft import LoraConfig
from transformers import BitsAndBytesConfig
from transformers.utils import is_rich_available

from grpo_hf.script_args import DatasetMixtureConfig, ModelConfig, ScriptArguments

logger = logging.getLogger(__name__)

# The `datasets` builder, and its options, for a data file's extension (after any compression suffix).
DATA_FILE_BUILDERS = {
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
    ".parquet": ("parquet", {}),
    ".arrow": ("arrow", {}),
}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")


def get_peft_config(model_args: ModelConfig) -> LoraConfig | None:
    """The LoRA adapter `model_args` describes (no bias terms trained), or None without `use_peft`."""
    if not model_args.use_peft:
        return None
    # Only when set: PEFT before 0.17 has no target_parameters.
    extra = (
        {"target_parameters": model_args.lora_target_parameters} if model_args.lora_target_parameters else {}
    )
    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
        modules_to_save=model_args.lora_modules_to_save,
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        bias="none",
        **extra,
    )


def get_quantization_config(model_args: ModelConfig) -> BitsAndBytesConfig | None:
    """bitsandbytes 4-bit or 8-bit loading as `model_args` asks, or None.

    4-bit computes in the model's `dtype`. Building the config needs no bitsandbytes; loading with
    it does (and a GPU it supports): `GRPOTrainer` says so before loading when it is missing.
    """
    if model_args.load_in_4bit:
        if model_args.dtype == "auto":
            raise ValueError(
                "load_in_4bit computes in `dtype`, which is 'auto' (the checkpoint's, unknown before loading); "
                "set dtype to bfloat16, float16 or float32."
            )
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=model_args.dtype,
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
            bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
        )
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def get_kbit_device_map() -> dict[str, int] | None:
    """`device_map` for a quantized model: the whole model on this process's accelerator
    (`{"": local process index}`), or None where there is no CUDA or XPU device."""
    if torch.cuda.is_available() or torch.xpu.is_available():
        return {"": PartialState().local_process_index}
    return None


def get_dataset(mixture_config: DatasetMixtureConfig) -> datasets.DatasetDict:
    """The mixture's datasets, each loaded with `datasets.load_dataset` (local files: `path='json'`
    and `data_files`, or a folder as `path`), cut to its `columns`, concatenated in order.

    With `fraction`s (all datasets or none), each is a share of the mixture: shares are the
    fractions normalised to sum 1, and the mixture is as large as it can be without repeating rows,
    `N = min(len_i / share_i)`, of which dataset i gives its first `round(share_i * N)` rows.
    Returns {'train'} or, with `test_split_size`, {'train', 'test'} (`train_test_split`, shuffled
    with `test_split_seed`: the same split on every process and every run).
    """
    configs = mixture_config.datasets
    if not configs:
        raise ValueError("The dataset mixture is empty: give `datasets` (a YAML list of datasets).")
    if mixture_config.streaming and mixture_config.test_split_size is not None:
        raise ValueError("`test_split_size` cannot be used with `streaming` (a stream cannot be split).")
    fractions = [config.fraction for config in configs]
    if any(f is not None for f in fractions):
        if any(f is None for f in fractions):
            raise ValueError("`fraction` must be set for every dataset of the mixture or for none.")
        if mixture_config.streaming:
            raise ValueError("`fraction` cannot be used with `streaming` (a stream has no length).")
        if min(fractions) < 0 or sum(fractions) == 0:
            raise ValueError(f"fractions {fractions}: each must be >= 0 and at least one > 0.")
    loaded = []
    for config in configs:
        logger.info("Loading %s (name=%s) for the dataset mixture", config.path, config.name)
        dataset = datasets.load_dataset(
            path=config.path,
            name=config.name,
            data_dir=config.data_dir,
            data_files=config.data_files,
            split=config.split,
            streaming=mixture_config.streaming,
        )
        loaded.append(dataset if config.columns is None else dataset.select_columns(config.columns))
    if fractions[0] is not None:
        shares = [f / sum(fractions) for f in fractions]
        size = min(len(dataset) / share for dataset, share in zip(loaded, shares, strict=True) if share > 0)
        loaded = [
            dataset.select(range(round(share * size))) for dataset, share in zip(loaded, shares, strict=True)
        ]
    mixture = datasets.concatenate_datasets(loaded)
    if mixture_config.test_split_size is not None:
        return mixture.train_test_split(
            test_size=mixture_config.test_split_size, seed=mixture_config.test_split_seed
        )
    return datasets.DatasetDict({"train": mixture})


def load_script_dataset(script_args: ScriptArguments) -> datasets.DatasetDict | datasets.IterableDatasetDict:
    """The dataset `script_args.dataset_name` names, with `dataset_config` and `dataset_streaming`.

    A local data file (JSON / JSONL, CSV / TSV, parquet, arrow; compressed too) is read by its
    builder, as the split 'train'; anything else (a Hub id, a local folder) goes to
    `datasets.load_dataset` as in TRL's script.
    """
    name, streaming = script_args.dataset_name, script_args.dataset_streaming
    path = Path(name)
    if not path.is_file():
        return datasets.load_dataset(name, name=script_args.dataset_config, streaming=streaming)
    suffixes = [s.lower() for s in path.suffixes]
    suffix = suffixes[-2] if len(suffixes) > 1 and suffixes[-1] in _COMPRESSIONS else path.suffix.lower()
    if suffix not in DATA_FILE_BUILDERS:
        raise ValueError(
            f"dataset_name={name!r} is a file `datasets` has no reader for by its extension {suffix!r}; use "
            f"one of {sorted(DATA_FILE_BUILDERS)}, a folder of such files, or a Hub id."
        )
    if script_args.dataset_config is not None:
        raise ValueError(
            f"dataset_config={script_args.dataset_config!r} names a configuration, and the single file "
            f"{name} has none; drop dataset_config."
        )
    builder, options = DATA_FILE_BUILDERS[suffix]
    return datasets.load_dataset(builder, data_files={"train": str(path)}, streaming=streaming, **options)


def init_zero_verbose() -> None:
    """Quiet a script: the root logger shows errors only (through `rich` when installed), and
    Python warnings go to the logging system as warnings, so they are hidden too. Call it first."""
    handler = _rich_handler() if is_rich_available() else logging.StreamHandler()
    logging.basicConfig(format="%(message)s", datefmt="[%X]", handlers=[handler], level=logging.ERROR)

    def log_warning(message, category, filename, lineno, file=None, line=None):
        logging.warning("%s:%s: %s: %s", filename, lineno, category.__name__, message)

    warnings.showwarning = log_warning


def _rich_handler() -> logging.Handler:
    from rich.logging import RichHandler

    return RichHandler()
