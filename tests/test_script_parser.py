"""TrlParser's answers to a person (grpo_hf.script_parser, grpo_hf.script_help): `--help` by the
section that declares each setting, one-line errors naming the closest flags, a missing --config
file answered with the files that exist, and TRL's `none` for optional numbers."""

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from grpo_hf import DatasetMixtureConfig, GRPOConfig, ModelConfig, ScriptArguments, TrlParser
from grpo_hf.config.loss_args import LossArguments
from grpo_hf.config.vllm_args import VLLMArguments
from grpo_hf.script_help import first_sentence, sections

TYPES = (ScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig)


def parser() -> TrlParser:
    return TrlParser(TYPES, prog="grpo-hf grpo")


def help_text(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as done:
        parser().parse_args_and_config(list(args))
    assert done.value.code == 0
    return capsys.readouterr().out


def test_sections_come_from_where_each_field_is_declared():
    found = {section.key: {a.dest for a in section.actions} for section in sections(parser(), list(TYPES))}
    assert list(found) == [
        "data",
        "model",
        "rollout",
        "loss",
        "generation",
        "vllm",
        "async",
        "grpo",
        "training",
    ]
    assert found["loss"] == {f.name for f in dataclasses.fields(LossArguments)}
    assert found["vllm"] == {f.name for f in dataclasses.fields(VLLMArguments)}
    # ScriptArguments' and DatasetMixtureConfig's fields share the data section.
    assert {"dataset_name", "datasets", "test_split_size"} <= found["data"]
    # A TrainingArguments default that GRPOConfig overrides stays with TrainingArguments.
    assert {"learning_rate", "bf16", "logging_steps"} <= found["training"]
    assert "precision" in found["grpo"] and "learning_rate" not in found["grpo"]


def test_a_new_field_lands_in_its_classes_section_without_another_edit():
    @dataclass
    class Extra(ScriptArguments):
        _help_section: ClassVar[tuple[str, str]] = ("script", "script: what this script adds")
        reward_funcs: list[str] | None = field(default=None, metadata={"help": "Rewards. More text."})

    @dataclass
    class Plain:
        knob: int = 1

    found = sections(TrlParser((Extra, Plain)), [Extra, Plain])
    assert [(s.key, [a.dest for a in s.actions]) for s in found][-2:] == [
        ("script", ["reward_funcs"]),
        ("plain", ["knob"]),
    ]


def test_help_is_short_and_grouped(capsys):
    text = help_text(capsys, "--help")
    assert len(text.splitlines()) < 250  # it was 1,233 lines in one group
    assert "GRPO, loss: policy term, importance sampling, KL (--help loss):" in text
    assert "\n  --beta  " in text or "\n  --beta " in text
    # One line per flag: the first sentence of its help, cut to the width.
    assert max(len(line) for line in text.splitlines()) <= 140
    assert "--learning_rate" in text and "--output_dir" in text  # TrainingArguments: names only


def test_help_of_one_section_is_in_full_with_the_files_values(tmp_path, capsys):
    text = help_text(capsys, "--help", "loss")
    assert "--beta BETA" in text and "(default: 0.0)" in text
    assert "--num_generations" not in text and "--learning_rate" not in text
    assert "--num_generations" in help_text(capsys, "--help", "all")
    config = tmp_path / "c.yaml"
    config.write_text("beta: 0.25\n")
    assert "(default: 0.25)" in help_text(capsys, "--config", str(config), "--help", "loss")


def test_an_unknown_help_section_is_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        parser().parse_args_and_config(["--help", "losses"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--help losses: no such section; the sections are data, model, rollout, loss" in err


def test_first_sentences_keep_abbreviations():
    assert first_sentence("Scale by std (Dr. GRPO). Other.") == "Scale by std (Dr. GRPO)"
    assert first_sentence("Modules, e.g. MoE experts. More.") == "Modules, e.g. MoE experts"
    assert first_sentence("Timeout in s.\n  Then an error.") == "Timeout in s"


def test_a_mistyped_flag_names_the_closest_ones():
    with pytest.raises(ValueError) as error:
        parser().parse_args_and_config(["--lerning-rate", "1e-4", "--num_generatoins", "4", "--zzz"])
    assert str(error.value) == (
        "unknown settings --lerning-rate (did you mean --learning_rate or --logging_strategy or "
        "--logging_steps?), --num_generatoins (did you mean --num_generations or --num_generations_eval or "
        "--num_iterations?), --zzz"
    )


def test_argparse_mistakes_are_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        parser().parse_args_and_config(["--learning_rate", "fast"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.splitlines() == [
        "grpo-hf grpo: error: argument --learning_rate/--learning-rate: invalid float value: 'fast' "
        "(`grpo-hf grpo --help` lists the settings)"
    ]


def test_unknown_keys_of_a_file_name_the_closest_ones(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("lora_rank: 8\n")
    with pytest.raises(ValueError, match=r"\['--lora_rank'\] \(lora_rank: did you mean lora_r"):
        TrlParser(ModelConfig).parse_args_and_config(["--config", str(config)])


def test_a_missing_config_names_the_files_that_exist(tmp_path):
    (tmp_path / "configs").mkdir()
    for name in ("smollm2_lora_arithmetic.yaml", "gpt2_lora_arithmetic.yaml"):
        (tmp_path / "configs" / name).write_text("lora_r: 8\n")
    typo = tmp_path / "configs" / "smollm2_lora_arithemtic.yaml"
    with pytest.raises(FileNotFoundError) as error:
        TrlParser(ModelConfig).parse_args_and_config(["--config", str(typo)])
    said = str(error.value)
    assert said.startswith(
        f"--config {typo}: no such file; YAML files in {tmp_path / 'configs'}/, the closest first: "
    )
    assert said.index("smollm2_lora_arithmetic.yaml") < said.index("gpt2_lora_arithmetic.yaml")
    # A folder that does not exist: the files below the nearest one that does.
    with pytest.raises(FileNotFoundError, match=r"config/x.yaml: no such file; .*configs/smollm2_lora"):
        TrlParser(ModelConfig).parse_args_and_config(["--config", str(tmp_path / "config" / "x.yaml")])


def test_none_for_an_optional_number_as_in_trl():
    (args,) = TrlParser(GRPOConfig).parse_args_and_config(
        [
            "--output_dir",
            "o",
            "--use_cpu",
            "--max_prompt_length",
            "None",
            "--num_completions_to_print",
            "4",
            "--vllm_max_model_length",
            "null",
        ]
    )
    assert args.max_prompt_length is None and args.vllm_max_model_length is None
    # A str setting keeps 'none' as text (report_to none means no integration), as in TRL.
    (model,) = TrlParser(ModelConfig).parse_args_and_config(["--attn_implementation", "none"])
    assert model.attn_implementation == "none"


def test_a_bool_that_may_be_unset_takes_no_as_trls_true_defaults_do():
    """TRL's gradient_checkpointing defaults to True, so TRL's parser has --no_gradient_checkpointing;
    ours is None until resolved, and takes the same flag."""
    common = ["--output_dir", "o", "--use_cpu"]
    (args,) = TrlParser(GRPOConfig).parse_args_and_config([*common, "--no_gradient_checkpointing"])
    assert args.gradient_checkpointing is False
    (args,) = TrlParser(GRPOConfig).parse_args_and_config(common)
    assert args.gradient_checkpointing is True
    (args,) = TrlParser(GRPOConfig).parse_args_and_config([*common, "--no-bf16", "--precision", "fp32"])
    assert args.bf16 is False
