"""The CPU's capability checks and its blocked matmul, with the plain fallback forced on any machine."""

import platform

import pytest
import torch
import torch.nn.functional as F
from trainer_helpers import make_config

from grpo_hf.engine import cpu
from grpo_hf.engine import native_bf16 as native_bf16_line
from grpo_hf.engine.cpu import BlockedLinear, blocked_matmul_supported

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.cpu_kind  # every check here depends on what the CPU (or GRPO_HF_CPU_BF16) says


def test_bf16_reorder_is_used_exactly_where_onednn_supports_it():
    """On an AVX2-only CPU oneDNN's bf16 reorder raises: the check must say no there, yes on AVX-512
    (unless GRPO_HF_CPU_BF16=0 runs the suite as on AVX2)."""
    expected = torch.ops.mkldnn._is_mkldnn_bf16_supported() and cpu.forced_bf16() is not False
    assert blocked_matmul_supported(torch.bfloat16) == expected
    assert not blocked_matmul_supported(torch.int8)  # no such kernel: never asked for


@pytest.mark.skipif(not X86, reason="oneDNN's float32 reorder is only claimed for x86 here")
def test_float32_reorder_runs_on_every_x86_cpu():
    assert blocked_matmul_supported(torch.float32) == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_reordered_weights_multiply_like_plain_ones(dtype):
    if not blocked_matmul_supported(dtype):
        pytest.skip(f"this CPU has no oneDNN {dtype} reorder (AVX-512 or AVX-NE-CONVERT needed for bf16)")
    torch.manual_seed(0)
    weight = torch.randn(96, 64).to(dtype)  # (out, in)
    linear = BlockedLinear(weight, rows=16)
    assert linear.packed
    for rows in (16, 3, 1):  # sized for 16 rows; a decoding batch never changes, but any count works
        x = torch.randn(rows, 64).to(dtype)
        # bf16: one rounding of a float32 sum either way; identical on AVX-512. float32: the blocked
        # kernel sums in another order.
        tolerance = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(linear(x), F.linear(x, weight), **tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_the_forced_fallback_is_a_plain_linear(dtype, monkeypatch):
    monkeypatch.setattr(cpu, "blocked_matmul_supported", lambda dtype: False)
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64).to(dtype), torch.randn(5, 64).to(dtype)
    linear = BlockedLinear(weight, rows=5)
    assert not linear.packed and linear.weight is weight
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=0, atol=0)


def test_no_rows_keeps_the_plain_weight():
    """rows=None (the fixed-shape decoder's: a compiled step reads the weight) never packs it, even
    where oneDNN could."""
    weight = torch.randn(96, 64)
    linear = BlockedLinear(weight, rows=None)
    assert not linear.packed and linear.weight is weight and linear.tensors() == (weight,)


def test_a_reorder_that_raises_means_unsupported(monkeypatch):
    """A oneDNN build that claims support but whose kernel raises (or misbehaves) falls back."""

    def raising(*args):
        raise RuntimeError("mkldnn_reorder_linear_weight: not on this CPU")

    blocked_matmul_supported.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", raising)
    try:
        assert not blocked_matmul_supported(torch.float32)
    finally:
        blocked_matmul_supported.cache_clear()


@pytest.fixture
def cleared_caches():
    """The answers are cached per process: clear them before and after a test that sets the variable."""
    caches = (cpu.native_bf16, blocked_matmul_supported)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def test_native_bf16_follows_the_instruction_sets(monkeypatch, cleared_caches):
    monkeypatch.delenv(cpu.CPU_BF16_VARIABLE, raising=False)
    expected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert cpu.native_bf16() == expected


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_variable_makes_the_cpu_run_as_the_other_kind(value, monkeypatch, cleared_caches, tmp_path):
    monkeypatch.setenv(cpu.CPU_BF16_VARIABLE, value)
    assert cpu.native_bf16() is (value == "1")
    native, line = native_bf16_line(use_cpu=True)
    assert native is (value == "1") and line.startswith(
        "precision: bf16" if value == "1" else "precision: fp32"
    )
    assert f"({cpu.CPU_BF16_VARIABLE} says so)" in line
    assert make_config(tmp_path, bf16=None, precision="auto").bf16 is (value == "1")
    if value == "0":  # as on AVX2: no oneDNN bf16 / fp16 reorder, whatever the CPU has; float32 keeps it
        assert not blocked_matmul_supported(torch.bfloat16) and not blocked_matmul_supported(torch.float16)
        assert blocked_matmul_supported(torch.float32) == torch.backends.mkldnn.is_available()


def test_a_bad_value_names_the_variable(monkeypatch, cleared_caches):
    monkeypatch.setenv(cpu.CPU_BF16_VARIABLE, "yes")
    with pytest.raises(ValueError, match="GRPO_HF_CPU_BF16='yes'"):
        cpu.native_bf16()
