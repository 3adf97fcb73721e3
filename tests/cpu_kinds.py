"""The suite's outcome does not depend on the CPU it runs on (a pytest plugin for tests/ and tests_vllm/).

`precision='auto'` and the CPU's fast paths follow what the CPU multiplies natively (`engine.cpu`),
so a test that meets them unawares passes on one kind of CPU and fails on the other. Here, by
construction:

- every test runs as on an AVX2-only CPU (`GRPO_HF_CPU_BF16=0`, set for the whole session and
  the processes it starts), whatever CPU runs it;
- a test marked `cpu_kind` (its path depends on native bf16) runs twice in the same session, as
  each kind: `[cpu=avx2]` and `[cpu=avx512bf16]` (the second emulated where the CPU lacks it).

`GRPO_HF_CPU_BF16=1 pytest tests` runs the unmarked tests as the other kind, to check that they
hold there too; the `cpu_kind` tests run as both kinds either way.
"""

import os

import pytest

from grpo_hf.engine import cpu

KINDS = {"avx2": "0", "avx512bf16": "1"}  # id -> GRPO_HF_CPU_BF16
PINNED = "0"  # the kind the unmarked tests run as: on an AVX2-only CPU, bf16 emulated would be slow


def clear_cpu_caches() -> None:
    cpu.native_bf16.cache_clear()
    cpu.blocked_matmul_supported.cache_clear()


def pytest_configure(config):
    """Before any test module is imported; xdist workers and subprocesses inherit the variable."""
    os.environ.setdefault(cpu.CPU_BF16_VARIABLE, PINNED)
    clear_cpu_caches()


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("cpu_kind"):
        metafunc.parametrize("cpu_kind", list(KINDS), indirect=True, ids=[f"cpu={kind}" for kind in KINDS])


@pytest.fixture(autouse=True)
def cpu_kind(request, monkeypatch):
    """GRPO_HF_CPU_BF16 for this test: each kind in turn for a `cpu_kind` test, else the pinned one."""
    kind = getattr(request, "param", None)
    if kind is not None:
        monkeypatch.setenv(cpu.CPU_BF16_VARIABLE, KINDS[kind])
        clear_cpu_caches()
    yield os.environ[cpu.CPU_BF16_VARIABLE]
    if kind is not None:
        monkeypatch.undo()
        clear_cpu_caches()
