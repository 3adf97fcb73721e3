"""The CPU's capability checks and its blocked matmul, with the plain fallback forced on any machine."""

import platform

import pytest
import torch
import torch.nn.functional as F

from grpo_hf.engine import cpu
from grpo_hf.engine.cpu import BlockedLinear, blocked_matmul_supported

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_bf16_reorder_is_used_exactly_where_onednn_supports_it():
    """On an AVX2-only CPU oneDNN's bf16 reorder raises: the check must say no there, yes on AVX-512."""
    assert blocked_matmul_supported(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
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


def test_native_bf16_follows_the_instruction_sets():
    expected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert cpu.native_bf16() == expected
