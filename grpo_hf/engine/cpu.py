"""What this CPU computes natively, and the CPU's fast matmul for decoding (oneDNN blocked weights).

CPUs differ in what they can do with bf16. With AVX-512-BF16 or AMX a bf16 matmul is about twice
as fast as a float32 one; without them (AVX2-only x86, most ARM builds of PyTorch) PyTorch's bf16
matmuls fall back to a reference GEMM many times slower than float32, and oneDNN's bf16 weight
reorder raises. Each fast path here asks once what the CPU can do and has a plain fallback that is
correct everywhere; tests force the fallback with `monkeypatch` on these functions.

`GRPO_HF_CPU_BF16` overrides what the CPU reports, for a whole process and its children (oneDNN's
and ATen's own switches, `ONEDNN_MAX_CPU_ISA` and `ATEN_CPU_CAPABILITY`, leave PyTorch's CPUID
answers as they are): `0` runs as on an AVX2-only CPU (no native bf16, no oneDNN bf16 or fp16
weight reorder), `1` as on a CPU with AVX-512-BF16 (precision='auto' picks bf16; its matmuls are
emulated where the CPU has no such instructions, so slow but the same code path). `make test`
uses it to run the precision-dependent tests as on the other kind of CPU.
"""

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

CPU_BF16_VARIABLE = "GRPO_HF_CPU_BF16"


def forced_bf16() -> bool | None:
    """`GRPO_HF_CPU_BF16` as a bool (0 -> as AVX2, 1 -> as AVX-512-BF16); None where it is unset."""
    value = os.environ.get(CPU_BF16_VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{CPU_BF16_VARIABLE}={value!r}: use 0 (run as on an AVX2-only CPU), 1 (as on one with "
            "AVX-512-BF16), or leave it unset to ask the CPU."
        )
    return None if value == "" else value == "1"


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 AVX-512-BF16 or AMX tiles), unless
    `GRPO_HF_CPU_BF16` says otherwise."""
    forced = forced_bf16()
    if forced is not None:
        return forced
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@functools.cache
def blocked_matmul_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder a `dtype` weight into its blocked layout and multiply by it here.

    oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, its fp16 one similar; the
    float32 one runs on any x86 oneDNN build. Beyond asking oneDNN, one small product is tried and
    compared with `F.linear`, so a build whose kernels misbehave (an ARM build, say) falls back too.
    `GRPO_HF_CPU_BF16=0` (as on an AVX2-only CPU) turns the bf16 and fp16 reorders off.
    """
    if dtype in (torch.bfloat16, torch.float16) and forced_bf16() is False:
        return False
    supported = {
        torch.float32: torch.backends.mkldnn.is_available,
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
    }.get(dtype)
    if supported is None or not torch.backends.mkldnn.is_available() or not supported():
        return False
    weight = torch.linspace(-1, 1, 64).view(8, 8).to(dtype)
    x = torch.linspace(1, -1, 16).view(2, 8).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2)
        product = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return torch.allclose(product.float(), F.linear(x, weight).float(), atol=1e-2)


class BlockedLinear:
    """x (rows, in) -> x @ weight.T for a fixed weight, in oneDNN's blocked layout where the CPU can.

    oneDNN reorders a plain weight into its blocked layout inside every matmul; for the few rows
    of a decoding step that reorder costs as much as the product itself. Reordering once
    (`_reorder_linear_weight`, sized for `rows`; `BlockedWeights` decides when again) halves the
    step's matmul time on the benchmark's shapes, with bit-identical bf16 results
    (`bench/levers.py`). Where `blocked_matmul_supported` says no (a GPU, a CPU without the
    instructions for this dtype) the weight is used as it is, through `F.linear`.
    """

    def __init__(self, weight: torch.Tensor, rows: int | None):
        """`rows`: the rows the blocked layout is sized for; None keeps the plain weight (what a step
        that `torch.compile` traces can read: inductor lowers oneDNN's product for constant weights only)."""
        self.packed = (
            rows is not None and weight.device.type == "cpu" and blocked_matmul_supported(weight.dtype)
        )
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows) if self.packed else weight

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What a call reads where a CUDA graph could read it: not oneDNN's packed weight (opaque,
        on a CPU)."""
        return () if self.packed else (self.weight,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


def weights_stamp(weights: tuple[torch.Tensor, ...]) -> tuple[tuple[int, int], ...]:
    """What changes when weights are replaced or written in place: each one's storage and version
    counter (bumped by in-place writes such as `GenerationCopy.refresh`'s `copy_`)."""
    return tuple((weight.data_ptr(), weight._version) for weight in weights)


class BlockedWeights:
    """One model's `BlockedLinear`s, reordered again only where a source weight changed.

    Generation reorders every weight it multiplies by; between rounds only some change (with LoRA,
    the merged q/k/v/o projections of the generation copy), so the rest (MLPs, LM head) are
    reordered once per model. A frozen weight counts as changed when its storage or version
    counter (bumped by in-place writes such as `GenerationCopy.refresh`'s `copy_`) differs from the
    one last reordered. A weight that requires grad is reordered every time: an optimizer may
    write it without bumping its version counter (fused AdamW does). What a maker made with an
    `update` method is updated in place instead of made again (`quantization.Fp8Matmul`, whose
    memory a CUDA graph reads).
    """

    def __init__(self):
        self.entries: dict[tuple, tuple] = {}  # (maker, ids) -> (weights, stamp, linear)

    def reorder(
        self, groups: list[tuple[torch.Tensor, ...]], rows: int | None, makers: list[Callable] | None = None
    ) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """x @ cat(group).T for each group of weights, as `BlockedLinear`s, or as what each group's
        maker (`makers`, called as `BlockedLinear` is: joined weight, rows) builds; entries of
        weights not asked for are dropped."""
        entries, linears = {}, []
        for weights, make in zip(groups, makers or [BlockedLinear] * len(groups), strict=True):
            key = (make, *(id(weight) for weight in weights))  # unique while the entry holds the weights
            stamp = weights_stamp(weights)
            cached = self.entries.get(key)
            if cached is None or cached[1] != stamp or any(weight.requires_grad for weight in weights):
                joined = torch.cat(weights) if len(weights) > 1 else weights[0]
                if cached is not None and hasattr(cached[2], "update"):
                    cached[2].update(joined)
                    cached = (weights, stamp, cached[2])
                else:
                    cached = (weights, stamp, make(joined, rows))
            entries[key] = cached
            linears.append(cached[2])
        self.entries = entries
        return linears
