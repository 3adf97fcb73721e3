"""Where a bench script writes its report by default: `bench/results/<date>-<name>-<machine>.json`.

The reports are committed beside the figures they back (docs/benchmarks.md), so a name says when, what
and on which machine: `2026-11-28-bench-amd-epyc-avx2.json`, `2026-11-28-gpu_decode-nvidia-h200.json`.
The machine is the first CUDA GPU's name where torch sees one, else the CPU's model and the widest
vector kind it has (read from the hardware, whatever `GRPO_HF_CPU_BF16` makes the suite believe),
and, where `ATEN_CPU_CAPABILITY` holds PyTorch's kernels to a narrower kind, that kind:
`amd-epyc-avx512bf16-as-avx2` is an AVX-512-BF16 EPYC running AVX2 kernels, not an AVX2 CPU.
"""

import datetime
import os
import platform
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def results_path(name: str) -> Path:
    """The default report file of the benchmark `name`, run today on this machine."""
    return RESULTS / f"{datetime.date.today().isoformat()}-{name}-{this_machine()}.json"


def this_machine() -> str:
    """This machine's name in report files (see the module docstring)."""
    import torch  # here, so that naming a file does not cost the import where torch is not needed

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu_model, flags = "", ""
    if Path("/proc/cpuinfo").is_file():
        text = Path("/proc/cpuinfo").read_text()
        cpu_model = next(iter(re.findall(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)), "")
        flags = next(iter(re.findall(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)), "")
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() or None
    return machine_name(cpu_model or platform.processor(), flags.split(), gpu, capability)


def machine_name(
    cpu_model: str, cpu_flags: list[str], gpu_name: str | None, capability: str | None = None
) -> str:
    """`nvidia-h200` for a GPU; for a CPU its model and vector kind, e.g. `amd-epyc-avx512bf16`, with
    `-as-avx2` where `capability` (`ATEN_CPU_CAPABILITY`) names a kind other than the CPU's."""
    if gpu_name:
        return _slug(gpu_name)
    flags = set(cpu_flags)
    kind = next((kind for kind, flag in _CPU_KINDS if flag in flags), platform.machine().lower() or "cpu")
    held = f"-as-{_slug(capability)}" if capability and capability != kind else ""
    return f"{_slug(cpu_model) or 'cpu'}-{kind}{held}"


# The widest kind first: native bf16 (AVX-512-BF16 or AMX), AVX-512, AVX2.
_CPU_KINDS = (
    ("avx512bf16", "avx512_bf16"),
    ("avx512bf16", "amx_bf16"),
    ("avx512", "avx512f"),
    ("avx2", "avx2"),
)


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|\bprocessor\b|\bcpu\b|@.*$", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")
