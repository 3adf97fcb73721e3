"""TRL's script utilities (grpo_hf.script_utils): get_peft_config, get_quantization_config,
get_kbit_device_map, get_dataset (local files; no hub here), init_zero_verbose."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_llama
from trainer_helpers import chat_dataset, length_reward, make_config
from transformers import BitsAndBytesConfig

from grpo_hf import (
    DatasetConfig,
    DatasetMixtureConfig,
    GRPOTrainer,
    ModelConfig,
    get_dataset,
    get_kbit_device_map,
    get_peft_config,
    get_quantization_config,
)

# ---- get_peft_config ----------------------------------------------------------------------------


def test_peft_config_only_with_use_peft():
    assert get_peft_config(ModelConfig()) is None


def test_peft_config_carries_every_lora_setting():
    config = get_peft_config(
        ModelConfig(
            use_peft=True,
            lora_r=4,
            lora_alpha=8,
            lora_dropout=0.1,
            lora_target_modules=["q_proj", "v_proj"],
            lora_modules_to_save=["lm_head"],
            use_rslora=True,
        )
    )
    assert isinstance(config, LoraConfig)
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.1)
    assert config.target_modules == {"q_proj", "v_proj"} and config.modules_to_save == ["lm_head"]
    assert (config.task_type, config.bias, config.use_rslora, config.use_dora) == (
        "CAUSAL_LM",
        "none",
        True,
        False,
    )
    assert not config.target_parameters  # not set unless asked for


def test_peft_config_adapts_what_it_names():
    model = get_peft_model(
        tiny_llama(),
        get_peft_config(ModelConfig(use_peft=True, lora_r=2, lora_target_modules=["q_proj", "v_proj"])),
    )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    # tiny_llama has 2 layers: q and v of each get lora_A and lora_B, nothing else trains.
    assert len(trainable) == 2 * 2 * 2 and all("lora_" in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable} == {"q_proj", "v_proj"}
    # rsLoRA's scale alpha / sqrt(r) = 32 / sqrt(2) = 22.627 (plain LoRA: 32 / 2 = 16).
    rs = get_peft_model(tiny_llama(), get_peft_config(ModelConfig(use_peft=True, lora_r=2, use_rslora=True)))
    assert rs.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == pytest.approx(
        22.627, abs=1e-3
    )


def test_peft_config_targets_parameters_when_asked():
    config = get_peft_config(ModelConfig(use_peft=True, lora_target_parameters=["mlp.experts.gate_up_proj"]))
    assert config.target_parameters == ["mlp.experts.gate_up_proj"]


# ---- get_quantization_config / get_kbit_device_map ---------------------------------------------


def test_quantization_config_4bit_8bit_or_none():
    assert get_quantization_config(ModelConfig()) is None
    four = get_quantization_config(
        ModelConfig(
            load_in_4bit=True, dtype="bfloat16", use_bnb_nested_quant=True, bnb_4bit_quant_storage="uint8"
        )
    )
    assert isinstance(four, BitsAndBytesConfig) and four.load_in_4bit and not four.load_in_8bit
    assert four.bnb_4bit_compute_dtype == torch.bfloat16  # the model's dtype
    assert (four.bnb_4bit_quant_type, four.bnb_4bit_use_double_quant) == ("nf4", True)
    assert four.bnb_4bit_quant_storage == torch.uint8
    eight = get_quantization_config(ModelConfig(load_in_8bit=True))
    assert eight.load_in_8bit and not eight.load_in_4bit
    with pytest.raises(ValueError, match="load_in_4bit computes in `dtype`, which is 'auto'"):
        get_quantization_config(ModelConfig(load_in_4bit=True, dtype="auto"))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_4bit_without_bitsandbytes_stops_the_trainer_before_loading(tmp_path):
    with pytest.raises(ImportError, match="bitsandbytes package is not installed.*--load_in_4bit"):
        GRPOTrainer(
            model="/no/such/model",  # never reached
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            train_dataset=chat_dataset(),
            quantization_config=get_quantization_config(ModelConfig(load_in_4bit=True)),
        )


def test_kbit_device_map(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert get_kbit_device_map() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert get_kbit_device_map() == {"": 0}  # one process: local index 0


# ---- get_dataset --------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path) -> Path:
    """a.jsonl: 10 rows a0..a9; b.jsonl: 4 rows b0..b3; each with prompt, id and a note column."""
    for name, n in (("a", 10), ("b", 4)):
        rows = [{"prompt": f"{name}{i}", "id": i, "note": "x"} for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def mixture(files: Path, fractions=(None, None), **kwargs) -> DatasetMixtureConfig:
    return DatasetMixtureConfig(
        datasets=[
            DatasetConfig(path="json", data_files=str(files / f"{name}.jsonl"), fraction=fraction)
            for name, fraction in zip("ab", fractions, strict=True)
        ],
        **kwargs,
    )


def test_mixture_concatenates_in_order(files):
    data = get_dataset(mixture(files))
    assert list(data) == ["train"]
    assert data["train"]["prompt"] == [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(4)]


def test_mixture_keeps_the_named_columns(files):
    config = mixture(files)
    config.datasets[0].columns = config.datasets[1].columns = ["prompt", "id"]
    assert get_dataset(config)["train"].column_names == ["prompt", "id"]


def test_fractions_are_shares_of_the_largest_mixture_without_repeats(files):
    # 3 : 1 -> shares 0.75, 0.25; N = min(10 / 0.75, 4 / 0.25) = min(13.33, 16) = 13.33;
    # a gives round(0.75 * 13.33) = 10 rows, b round(0.25 * 13.33) = round(3.33) = 3.
    data = get_dataset(mixture(files, (3, 1)))["train"]
    assert data["prompt"] == [f"a{i}" for i in range(10)] + ["b0", "b1", "b2"]
    # 1 : 1 -> N = min(10 / 0.5, 4 / 0.5) = 8: the first 4 of each.
    data = get_dataset(mixture(files, (0.5, 0.5)))["train"]
    assert data["prompt"] == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    # A share of 0 keeps none of that dataset: N = 10 / 1.
    assert get_dataset(mixture(files, (1, 0)))["train"]["prompt"] == [f"a{i}" for i in range(10)]


def test_test_split(files):
    data = get_dataset(mixture(files, test_split_size=4))
    assert (len(data["train"]), len(data["test"])) == (10, 4)
    assert sorted([*data["train"]["prompt"], *data["test"]["prompt"]]) == sorted(
        [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(4)]
    )


def test_the_test_split_is_the_same_on_every_call_whatever_numpy_s_random_state(files):
    """Every process and every run split alike: the split has its own seed (test_split_seed), not
    NumPy's global random state, which nothing has seeded when a script calls get_dataset."""

    def split(numpy_seed: int, **seed) -> tuple[list[str], list[str]]:
        np.random.seed(numpy_seed)
        data = get_dataset(mixture(files, test_split_size=4, **seed))
        return list(data["train"]["prompt"]), list(data["test"]["prompt"])

    first = split(0)
    assert split(1) == first and split(2, test_split_seed=0) == first  # the default seed is 0
    assert split(0, test_split_seed=1) != first
    assert split(3, test_split_seed=1) == split(4, test_split_seed=1)


def test_a_local_folder_as_path(files):
    folder = files / "data"
    folder.mkdir()
    (files / "a.jsonl").rename(folder / "train.jsonl")
    (files / "b.jsonl").rename(folder / "test.jsonl")
    config = DatasetMixtureConfig(datasets=[DatasetConfig(path=str(folder), split="test")])
    assert get_dataset(config)["train"]["prompt"] == ["b0", "b1", "b2", "b3"]


def test_streamed_mixture(files):
    data = get_dataset(mixture(files, streaming=True))["train"]
    assert [row["prompt"] for row in data][9:11] == ["a9", "b0"]


def test_mixture_errors(files):
    with pytest.raises(ValueError, match="set for every dataset of the mixture or for none"):
        get_dataset(mixture(files, (0.5, None)))
    with pytest.raises(ValueError, match="`fraction` cannot be used with `streaming`"):
        get_dataset(mixture(files, (0.5, 0.5), streaming=True))
    with pytest.raises(ValueError, match=r"fractions \[0, 0\]: each must be >= 0"):
        get_dataset(mixture(files, (0, 0)))
    with pytest.raises(ValueError, match=r"fractions \[1, -1\]"):
        get_dataset(mixture(files, (1, -1)))
    with pytest.raises(ValueError, match="`test_split_size` cannot be used with `streaming`"):
        get_dataset(mixture(files, streaming=True, test_split_size=2))
    with pytest.raises(ValueError, match="The dataset mixture is empty"):
        get_dataset(DatasetMixtureConfig())


# ---- init_zero_verbose --------------------------------------------------------------------------


def test_zero_verbose_shows_errors_only():
    script = (
        "import logging, warnings\n"
        "from grpo_hf import init_zero_verbose\n"
        "init_zero_verbose()\n"
        "logging.getLogger('some.library').warning('a library warning')\n"
        "warnings.warn('a python warning')\n"
        "logging.getLogger('some.library').error('an error')\n"
        "logging.getLogger().setLevel(logging.WARNING)\n"  # now warnings show: through logging
        "warnings.warn('a later warning')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "an error" in output
    assert "a library warning" not in output and "a python warning" not in output
    assert "UserWarning: a later warning" in output  # the logging format: file:line: Category: message
