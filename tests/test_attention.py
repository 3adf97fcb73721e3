"""Grouped float32 attention against PyTorch's SDPA, and one case by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from grpo_hf.engine.attention import grouped_attention


def test_two_keys_by_hand():
    query = torch.tensor([[[[1.0, 0.0]]]])  # (R, H, W, d) = (1, 1, 1, 2)
    key = torch.tensor([[[[2.0, 0.0], [0.0, 5.0]]]])  # (1, 1, L, d): scores 2 and 0 at scale 1
    value = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    out = grouped_attention(query, key, value, None, scale=1.0)
    weight = math.exp(2) / (math.exp(2) + 1)  # softmax(2, 0)[0] = 0.8808
    torch.testing.assert_close(out, torch.tensor([[[[weight, 1 - weight]]]]))
    masked = grouped_attention(query, key, value, torch.tensor([[[[float("-inf"), 0.0]]]]), scale=1.0)
    torch.testing.assert_close(masked, torch.tensor([[[[0.0, 1.0]]]]))  # only the second key is visible


@pytest.mark.parametrize(("heads", "kv_heads", "width"), [(6, 2, 5), (4, 4, 3), (9, 3, 1)])
def test_matches_sdpa_with_grouped_queries(heads, kv_heads, width):
    torch.manual_seed(0)
    rows, length, dim = 3, 7, 8
    query = torch.randn(rows, heads, width, dim)
    key, value = torch.randn(2, rows, kv_heads, length, dim)
    allowed = torch.rand(rows, 1, width, length) > 0.3
    allowed[..., 0] = True  # every query sees at least one key
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    out = grouped_attention(query, key, value, bias, scale=0.3)
    expected = F.scaled_dot_product_attention(query, key, value, allowed, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_bf16_inputs_are_attended_in_float32_and_returned_in_bf16():
    torch.manual_seed(0)
    query, key, value = (torch.randn(3, 1, 4, 3, 8) * 4).to(torch.bfloat16).unbind(0)  # (1, 4, 3, 8) each
    out = grouped_attention(query, key, value, None)
    assert out.dtype == torch.bfloat16
    exact = grouped_attention(query.float(), key.float(), value.float(), None)  # the same bf16 values
    torch.testing.assert_close(out, exact.to(torch.bfloat16), rtol=0, atol=0)  # one rounding, at the end


def test_under_autocast_products_run_in_its_dtype_as_transformers_attention_does():
    torch.manual_seed(0)
    query, key, value = (torch.randn(3, 2, 4, 3, 8) * 4).to(torch.bfloat16).unbind(0)  # (2, 4, 3, 8) each
    key, value = key[:, :2], value[:, :2]  # two key heads for four query heads
    bias = torch.zeros(2, 1, 3, 3).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_attention(query, key, value, bias)
    # The same steps by hand in bf16: q k^T, scale, mask, softmax, times v.
    q = query.view(2, 2, 2, 3, 8)  # (R, Hkv, G, W, d)
    scores = (q @ key.unsqueeze(2).transpose(-1, -2)) * 8**-0.5 + bias.unsqueeze(2).bfloat16()
    expected = (scores.softmax(dim=-1) @ value.unsqueeze(2)).view(2, 4, 3, 8)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    float32 = grouped_attention(query, key, value, bias)  # without autocast: float32 inside
    assert (out.float() - float32.float()).abs().max() > 0
