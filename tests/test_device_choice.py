"""The device follows the hardware (issue 44): no shipped recipe config or Makefile default names the CPU.
With a GPU mocked (torch says it sees one), every recipe config resolves to the GPU and `make train`
launches with recipes/accelerate/gpu.yaml; without an accelerator, each config resolves exactly as it
did when the configs said `use_cpu: true`, and `make train` launches with cpu.yaml."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState

from grpo_hf import GRPOConfig
from grpo_hf.engine import cpu

ROOT = Path(__file__).resolve().parent.parent
RECIPE_CONFIGS = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
GRPO_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)}


def recipe_config(path: Path, tmp_path: Path, **overrides) -> GRPOConfig:
    """The GRPOConfig a recipe config gives (its GRPOConfig keys; no reporting, output under tmp_path)."""
    settings = {key: value for key, value in yaml.safe_load(path.read_text()).items() if key in GRPO_FIELDS}
    return GRPOConfig(**(settings | {"output_dir": str(tmp_path), "report_to": []} | overrides))


@pytest.fixture
def one_gpu(monkeypatch):
    """torch sees one CUDA GPU that computes bf16 (an H100, say); accelerate's state is reset after."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)  # no CUDA state left for the next test


@pytest.fixture
def no_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: p.name)
def test_every_recipe_config_trains_on_the_gpu_where_there_is_one(path, tmp_path, one_gpu):
    args = recipe_config(path, tmp_path)
    assert args.device == torch.device("cuda", 0) and args.n_gpu == 1
    assert not args.use_cpu and args.bf16  # precision: auto, on a GPU that computes bf16


@pytest.mark.cuda
@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: p.name)
def test_on_this_gpu_every_recipe_config_trains_on_it(path, tmp_path):
    args = recipe_config(path, tmp_path)
    assert args.device.type == "cuda" and not args.use_cpu
    assert args.bf16 is torch.cuda.is_bf16_supported(including_emulation=False)


@pytest.mark.cpu_kind
@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: p.name)
def test_without_an_accelerator_a_recipe_config_resolves_as_with_use_cpu(path, tmp_path, no_accelerator):
    args = recipe_config(path, tmp_path)
    assert args.device == torch.device("cpu") and args.use_cpu and args.bf16 is cpu.native_bf16()
    assert not args.dataloader_pin_memory  # no memory pinned for a GPU that is not there
    assert args.to_dict() == recipe_config(path, tmp_path, use_cpu=True).to_dict()


def launcher_config(tmp_path: Path, gpu: bool) -> Path:
    """The --config_file `make train` launches with, where the environment's torch sees a GPU or not: a
    dry run (make -n) with BIN pointing to a python whose torch.cuda.is_available answers `gpu`."""
    site, bin_dir = tmp_path / "site", tmp_path / "bin"
    site.mkdir()
    bin_dir.mkdir()
    (site / "sitecustomize.py").write_text(f"import torch\ntorch.cuda.is_available = lambda: {gpu}\n")
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (bin_dir / ".installed").touch()  # installed: make's dry run shows the training command only
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_CONFIG", "MAKEFLAGS")}
    done = subprocess.run(
        ["make", "-n", "train", f"BIN={bin_dir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (launch,) = [line for line in done.stdout.splitlines() if "accelerate launch" in line]
    return ROOT / launch.split("--config_file ")[1].split()[0]


@pytest.mark.slow
@pytest.mark.parametrize(("gpu", "name"), [(True, "gpu.yaml"), (False, "cpu.yaml")])
def test_make_train_launches_on_the_device_torch_sees(tmp_path, gpu, name):
    config = launcher_config(tmp_path, gpu)
    assert config == ROOT / "recipes" / "accelerate" / name
    launcher = yaml.safe_load(config.read_text())
    assert (launcher["distributed_type"], launcher["num_processes"]) == ("NO", 1)
    # use_cpu only on the CPU, where accelerate then gives the process a thread per physical core.
    assert launcher.get("use_cpu", False) is not gpu
