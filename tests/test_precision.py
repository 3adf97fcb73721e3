"""precision='auto': bf16 only where the device multiplies it natively, logged once; a warning for
an explicit --bf16 where bf16 is emulated. The CPU's answer is monkeypatched both ways."""

import logging
import math
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, length_reward, make_config

from grpo_hf import GRPOConfig, GRPOTrainer, TrlParser
from grpo_hf.engine import cpu


@pytest.fixture(params=[True, False], ids=["native-bf16", "no-native-bf16"])
def native(request, monkeypatch) -> bool:
    """A machine without a GPU whose CPU has native bf16 or not."""
    monkeypatch.setattr(cpu, "native_bf16", lambda: request.param)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return request.param


def test_auto_picks_bf16_only_where_the_cpu_computes_it(tmp_path, native):
    args = make_config(tmp_path, precision="auto", bf16=None, use_cpu=False)
    assert args.bf16 is native and not args.fp16
    assert args.use_cpu or not native  # transformers wants use_cpu for bf16 on a CPU


@pytest.mark.cpu_kind
def test_auto_on_this_machine_follows_its_instruction_sets(tmp_path):
    assert make_config(tmp_path, precision="auto", bf16=None).bf16 is cpu.native_bf16()


@pytest.mark.cuda
def test_auto_on_a_gpu_follows_the_gpu(tmp_path):
    args = make_config(tmp_path, precision="auto", bf16=None, use_cpu=False)
    assert args.bf16 is torch.cuda.is_bf16_supported(including_emulation=False)


@pytest.mark.parametrize(("precision", "bf16"), [("bf16", True), ("fp32", False)])
def test_named_precisions(tmp_path, precision, bf16):
    assert make_config(tmp_path, precision=precision, bf16=None).bf16 is bf16


@pytest.mark.parametrize(
    "kwargs",
    [{"precision": "auto", "bf16": True}, {"precision": "fp32", "bf16": True}, {"precision": "half"}],
)
def test_conflicting_or_unknown_precision_names_the_setting(tmp_path, kwargs):
    with pytest.raises(ValueError, match="precision"):
        GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8, num_generations=4, **kwargs
        )


@pytest.mark.parametrize(
    ("kwargs", "flags"),
    [
        ({"precision": "auto", "bf16": True}, ["--precision bf16", "--bf16 true"]),
        ({"precision": "auto", "bf16": False}, ["--precision fp32", "--bf16 false"]),
        ({"precision": "bf16", "bf16": False}, ["--precision fp32", "--bf16 false"]),
        ({"precision": "fp32", "fp16": True}, ["--fp16 true"]),
        ({"precision": "half"}, ["--precision bf16", "--precision fp32", "--fp16 true"]),
    ],
)
def test_every_precision_error_names_the_flags_that_work(tmp_path, kwargs, flags):
    """precision='auto' with bf16=False was silently bf16 on a CPU with native bf16; now every
    contradiction is refused, naming the flags that say what was meant."""
    with pytest.raises(ValueError) as error:
        GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, **kwargs)
    assert all(flag in str(error.value) for flag in flags), str(error.value)


def parse_with_file(tmp_path, file: str, *flags: str) -> GRPOConfig:
    config = tmp_path / "config.yaml"
    config.write_text(file)
    common = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "8", "--num_generations", "4"]
    (args,) = TrlParser(GRPOConfig).parse_args_and_config(["--config", str(config), *common, *flags])
    return args


@pytest.mark.parametrize(
    ("file", "flags", "bf16", "fp16"),
    [
        ("precision: auto\n", ["--bf16", "false"], False, False),
        ("precision: auto\n", ["--bf16", "true"], True, False),
        ("precision: auto\n", ["--fp16", "true"], False, True),
        ("bf16: true\n", ["--precision", "fp32"], False, False),
        ("precision: fp32\nbf16: false\n", ["--precision", "bf16"], True, False),
    ],
)
def test_a_flag_on_the_command_line_wins_over_the_files_precision(tmp_path, native, file, flags, bf16, fp16):
    """The shipped configs say `precision: auto`: `--bf16 false` (as docs/scaling.md says) trains in
    float32 on every CPU, and `--bf16 true` / `--fp16` are taken instead of refused."""
    args = parse_with_file(tmp_path, file, *flags)
    assert (args.bf16, args.fp16) == (bf16, fp16)
    assert args.use_cpu or not bf16  # bf16 without a GPU trains on the CPU


def test_the_files_precision_stays_without_a_precision_flag(tmp_path, native):
    args = parse_with_file(tmp_path, "precision: auto\n", "--learning_rate", "0.5")
    assert (args.precision, args.bf16, args.learning_rate) == ("auto", native, 0.5)
    with pytest.raises(ValueError, match="--precision fp32"):
        parse_with_file(tmp_path, "precision: auto\nbf16: false\n")  # one file saying both: refused


def make_trainer(tmp_path, **overrides) -> GRPOTrainer:
    return GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, **overrides),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )


def test_the_choice_is_logged_once_at_start(tmp_path, native, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_hf.trainer"):
        make_trainer(tmp_path, precision="auto", bf16=None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision:")]
    assert len(lines) == 1
    assert lines[0].startswith("precision: bf16" if native else "precision: fp32")
    assert native or "has no native bf16" in lines[0]


def test_explicit_bf16_warns_only_where_it_is_emulated(tmp_path, native, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_hf.trainer"):
        make_trainer(tmp_path, bf16=True)
    warned = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warned) == (0 if native else 1)
    assert native or "precision='auto'" in warned[0]


@pytest.mark.cpu_kind
def test_a_step_at_the_machines_precision(tmp_path):
    """precision='auto' trains: bf16 autocast where the CPU has it (or GRPO_HF_CPU_BF16=1 says so), float32
    elsewhere; the loss is finite, the weights move and stay float32 (the optimizer's master copy)."""
    trainer = make_trainer(tmp_path, bf16=None, precision="auto", max_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.args.bf16 is cpu.native_bf16()
    (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"])
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


@pytest.mark.parametrize(("launcher", "precision", "refused"), [
    ("bf16", "fp32", True), ("fp16", "bf16", True), ("bf16", "bf16", False), ("no", "fp32", False),
])  # fmt: skip
def test_a_launcher_precision_other_than_the_runs_is_refused(
    tmp_path, monkeypatch, launcher, precision, refused
):
    """`accelerate launch` exports its config's mixed_precision, which transformers trains in whenever
    bf16 and fp16 are off: a float32 run under a bf16 launcher config would silently train in bf16."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    if refused:
        with pytest.raises(ValueError, match=f"mixed_precision: {launcher}.*mixed_precision: 'no'"):
            make_config(tmp_path, bf16=None, precision=precision)
    else:
        assert make_config(tmp_path, bf16=None, precision=precision).bf16 is (precision == "bf16")


def test_no_shipped_launcher_config_sets_the_precision():
    """The recipes' precision decides (bf16 where the device has it): no accelerate config overrides it."""
    import yaml

    configs = sorted((Path(__file__).resolve().parents[1] / "recipes" / "accelerate").glob("*.yaml"))
    assert len(configs) >= 9
    for path in configs:
        assert yaml.safe_load(path.read_text()).get("mixed_precision", "no") == "no", path.name
