"""TRL's script arguments (grpo_hf.script_args): ScriptArguments, ModelConfig, DatasetMixtureConfig
and TrlParser's `--config` YAML, checked against TRL 1.16's fields, defaults and semantics."""

import dataclasses
import os
from dataclasses import dataclass

import pytest

from grpo_hf import (
    DatasetConfig,
    DatasetMixtureConfig,
    GRPOConfig,
    ModelConfig,
    ScriptArguments,
    TrlParser,
)

# TRL 1.16's defaults (trl/scripts/utils.py, trl/trainer/model_config.py), field by field, in order.
TRL_SCRIPT_ARGUMENTS = {
    "dataset_name": None,
    "dataset_config": None,
    "dataset_train_split": "train",
    "dataset_test_split": "test",
    "dataset_streaming": False,
    "ignore_bias_buffers": False,
}
TRL_MODEL_CONFIG = {
    "model_name_or_path": None,
    "model_revision": "main",
    "dtype": "float32",
    "attn_implementation": None,
    "use_peft": False,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "lora_target_modules": None,
    "lora_target_parameters": None,
    "lora_modules_to_save": None,
    "lora_task_type": "CAUSAL_LM",
    "use_rslora": False,
    "use_dora": False,
    "load_in_8bit": False,
    "load_in_4bit": False,
    "bnb_4bit_quant_type": "nf4",
    "use_bnb_nested_quant": False,
    "bnb_4bit_quant_storage": None,
}
TRL_DATASET_CONFIG = {
    "name": None,
    "data_dir": None,
    "data_files": None,
    "split": "train",
    "columns": None,
    "fraction": None,
}


def test_fields_and_defaults_are_trls():
    assert dataclasses.asdict(ScriptArguments()) == TRL_SCRIPT_ARGUMENTS
    assert [f.name for f in dataclasses.fields(ScriptArguments)] == list(TRL_SCRIPT_ARGUMENTS)
    assert dataclasses.asdict(ModelConfig()) == TRL_MODEL_CONFIG
    assert [f.name for f in dataclasses.fields(ModelConfig)] == list(TRL_MODEL_CONFIG)
    assert dataclasses.asdict(DatasetConfig(path="p")) == {"path": "p", **TRL_DATASET_CONFIG}
    assert dataclasses.asdict(DatasetMixtureConfig()) == {
        "datasets": [],
        "streaming": False,
        "test_split_size": None,
        "test_split_seed": 0,  # ours: TRL's split is unseeded
    }


def test_model_config_checks_and_the_single_target_module():
    with pytest.raises(ValueError, match="load_in_8bit and load_in_4bit are both set"):
        ModelConfig(load_in_8bit=True, load_in_4bit=True)
    with pytest.raises(ValueError, match=r"dtype='float64': use one of \['auto', 'bfloat16'"):
        ModelConfig(dtype="float64")
    with pytest.raises(ValueError, match="bnb_4bit_quant_type='int4'"):
        ModelConfig(bnb_4bit_quant_type="int4")
    # One module is one PEFT pattern (a string: 'all-linear' or a regex); two stay a list of names.
    assert ModelConfig(lora_target_modules=["all-linear"]).lora_target_modules == "all-linear"
    assert ModelConfig(lora_target_modules=["q_proj", "v_proj"]).lora_target_modules == ["q_proj", "v_proj"]
    assert ModelConfig(dtype=None).dtype is None


def test_mixture_reads_datasets_from_mappings_and_names_bad_keys():
    mixture = DatasetMixtureConfig(datasets=[{"path": "json", "data_files": "a.jsonl", "fraction": 0.5}])
    assert mixture.datasets == [DatasetConfig(path="json", data_files="a.jsonl", fraction=0.5)]
    with pytest.raises(ValueError, match=r"datasets\[0\] has unknown keys \['fractoin'\]"):
        DatasetMixtureConfig(datasets=[{"path": "json", "fractoin": 0.5}])
    with pytest.raises(ValueError, match=r"datasets\[1\] has no `path`"):
        DatasetMixtureConfig(datasets=[{"path": "json"}, {"split": "train"}])


# ---- TrlParser ----------------------------------------------------------------------------------


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


CONFIG = """
env:
  GRPO_HF_TEST_SETTING: 7
model_name_or_path: some/model
lora_r: 8
lora_target_modules: [q_proj, v_proj]
learning_rate: 3e-4   # YAML reads this as a string; argparse converts a string default with the type
max_steps: 50
bf16: false
dataset_name: data
"""


def test_yaml_gives_defaults_the_command_line_overrides_and_env_is_set(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_HF_TEST_SETTING", raising=False)  # restored (absent) after the test
    config = write(tmp_path / "c.yaml", CONFIG)
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script, training, model = parser.parse_args_and_config(
        ["--config", config, "--max_steps", "2", "--lora_r", "4", "--output_dir", str(tmp_path)]
    )
    assert os.environ["GRPO_HF_TEST_SETTING"] == "7"  # env values become strings
    assert (training.max_steps, model.lora_r) == (2, 4)  # the command line wins
    assert training.learning_rate == 3e-4 and isinstance(training.learning_rate, float)
    assert training.bf16 is False
    assert model.model_name_or_path == "some/model" and model.lora_target_modules == ["q_proj", "v_proj"]
    assert model.lora_alpha == 32  # in neither: the dataclass's default
    assert script.dataset_name == "data" and script.dataset_train_split == "train"


def test_a_trl_script_parses_the_dataset_mixture_with_grpo_config(tmp_path):
    """trl/scripts/grpo.py's four classes in one parser: no option defined twice (GRPOConfig has
    --seed, the mixture's seed is --test_split_seed)."""
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    *_, training, _, mixture = parser.parse_args_and_config(
        [
            "--output_dir",
            str(tmp_path),
            "--seed",
            "3",
            "--test_split_seed",
            "5",
            "--use_cpu",
            "--bf16",
            "false",
        ]
    )
    assert (training.seed, mixture.test_split_seed) == (3, 5)


def test_without_config_it_is_hf_argument_parser():
    (model,) = TrlParser(ModelConfig).parse_args_and_config(
        ["--use_peft", "--lora_target_modules", "all-linear"]
    )
    assert model.use_peft is True and model.lora_target_modules == "all-linear"
    with pytest.raises(ValueError, match=r"unknown setting --lora_rank \(did you mean --lora_r"):
        TrlParser(ModelConfig).parse_args_and_config(["--lora_rank", "4"])


def test_config_equals_form_and_a_required_field_given_by_the_file(tmp_path):
    @dataclass
    class Arguments:  # TRL's docstring example: arg1 has no default
        arg1: int
        arg2: str = "alpha"

    config = write(tmp_path / "c.yaml", "arg1: 23\n")
    assert TrlParser([Arguments]).parse_args_and_config([f"--config={config}"]) == (Arguments(23, "alpha"),)
    assert TrlParser([Arguments]).parse_args_and_config(["--arg1", "5", "--arg2", "beta"]) == (
        Arguments(5, "beta"),
    )


def test_unknown_keys_of_the_file(tmp_path):
    config = write(tmp_path / "c.yaml", "lora_r: 8\nlora_rank: 4\nwarmup: 0.1\n")
    with pytest.raises(ValueError, match=r"Unknown settings in .*c.yaml: \['--lora_rank', '--warmup'\]"):
        TrlParser(ModelConfig).parse_args_and_config(["--config", config])
    # trl/scripts/grpo.py parses with fail_with_unknown_args=False: they are dropped.
    (model,) = TrlParser(ModelConfig).parse_args_and_config(
        ["--config", config], fail_with_unknown_args=False
    )
    assert model.lora_r == 8
    # Or handed back, the file's first, joined with the command line's or apart.
    parsed = TrlParser(ModelConfig).parse_args_and_config(
        ["--config", config, "--extra", "1"], return_remaining_strings=True
    )
    assert parsed[1] == ["--lora_rank", "4", "--warmup", "0.1", "--extra", "1"]
    parsed = TrlParser(ModelConfig).parse_args_and_config(
        ["--config", config, "--extra", "1"], return_remaining_strings=True, separate_remaining_strings=True
    )
    assert parsed[1:] == (["--lora_rank", "4", "--warmup", "0.1"], ["--extra", "1"])


def test_bad_files_and_the_reserved_config_field(tmp_path):
    with pytest.raises(ValueError, match="must contain a YAML mapping"):
        TrlParser(ModelConfig).parse_args_and_config(["--config", write(tmp_path / "a.yaml", "- lora_r\n")])
    with pytest.raises(ValueError, match="`env` in .* must be a mapping"):
        TrlParser(ModelConfig).parse_args_and_config(["--config", write(tmp_path / "b.yaml", "env: [A]\n")])
    with pytest.raises(ValueError, match="--config needs the path"):
        TrlParser(ModelConfig).parse_args_and_config(["--lora_r", "4", "--config"])
    with pytest.raises(FileNotFoundError):
        TrlParser(ModelConfig).parse_args_and_config(["--config", str(tmp_path / "missing.yaml")])

    @dataclass
    class WithConfig:
        config: str = "x"

    with pytest.raises(ValueError, match="WithConfig has a field named 'config'"):
        TrlParser(WithConfig)


def test_defaults_reach_subparsers():
    parser = TrlParser()
    child = parser.add_subparsers(dest="command").add_parser("grpo")
    child.add_argument("--lr", type=float, default=1.0, required=True)
    assert parser.set_defaults_with_config(lr=0.5, other=2) == ["--other", "2"]
    (action,) = [a for a in child._actions if a.dest == "lr"]
    assert (action.default, action.required) == (0.5, False)


def test_mixture_from_the_yaml_file_and_the_command_line(tmp_path):
    config = write(
        tmp_path / "c.yaml",
        "datasets:\n  - path: json\n    data_files: [a.jsonl, b.jsonl]\n    columns: [prompt]\ntest_split_size: 0.25\n",
    )
    (mixture,) = TrlParser(DatasetMixtureConfig).parse_args_and_config(["--config", config])
    assert mixture.datasets == [
        DatasetConfig(path="json", data_files=["a.jsonl", "b.jsonl"], columns=["prompt"])
    ]
    assert mixture.test_split_size == 0.25
    (mixture,) = TrlParser(DatasetMixtureConfig).parse_args_and_config(["--datasets", "data", "more"])
    assert mixture.datasets == [DatasetConfig(path="data"), DatasetConfig(path="more")]
