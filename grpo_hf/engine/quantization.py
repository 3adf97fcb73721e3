"""Low-precision rollouts: the sampler's matmuls on 8-bit weights (`rollout_quantization`).

Decoding a few rows at a time reads every weight once per token, so a step costs about what its
weights weigh: 8-bit weights are half the bytes of bf16 ones and a quarter of float32 ones. Each
weight is rounded per output channel (row). For int8: scale = max |w_row| / 127, q = round(w /
scale) in [-127, 127], w ~ q * scale. Three kinds:

- 'int8' (`Int8Matmul`): PyTorch's dynamic int8 linear (`torch.ops.quantized.linear_dynamic`,
  fbgemm): the activations rounded to 8-bit integers at each call, one scale per call (over all
  its rows), int32 sums, the weight scales applied on the way out. 7 bits (`reduce_range`, as
  `quantize_dynamic` does on x86) only where fbgemm's kernels lack VNNI (AVX2): there its 8-bit
  products can saturate 16-bit sums; VNNI sums in 32 bits, and the 8th bit halves the
  activations' rounding (`full_range_activations`). The fastest int8 path PyTorch 2.13 and
  torchao 0.18 offer on a CPU (`bench/int8_kernels.py`, docs/benchmarks.md: 2 threads, AVX-512-BF16
  + VNNI EPYC, idle): the LM head's 16 x 576 -> 49,152 took 2.0 ms against 3.3 ms for the bf16
  product on oneDNN's blocked weights that decoding runs today; `aten._weight_int8pack_mm` (int8
  weights, bf16 activations) 11 ms, `torch._int_mm` with per-row activations 3.8 ms; torchao's
  `Int8DynamicActivationInt8WeightConfig` about 100 ms (a loaded machine). But rounding the
  activations moves the sampler far from the policy on SmolLM2-135M, whose activations have outlier
  channels (the MLP's down projection's input above all): per-token KL(policy || sampler) 0.14 over
  decoding steps and 1.2 at the first token (the prefill's rows share one scale), against 0.0012 and
  0.0035 for the bf16 copy; trained with it, `make train`'s recipe scored 6 to 19 points lower on
  held-out problems than with the bf16 copy over three seeds, whichever correction (none,
  `sampler_is_cap` 2, and that with `off_policy_mask_threshold` 0.5). Off by default.
- 'int8_weight_only' (`Int8WeightOnlyMatmul`): the weights' rounding alone (KL 0.0049), multiplied
  in the copy's dtype by the dequantized weights: an int8 weight-only sampler's precision at the
  copy's own speed, since PyTorch's weight-only kernel is slower than that.
- 'fp8' (`Fp8Matmul`): weights in float8 e4m3 with one scale per output channel, activations
  rounded to e4m3 at each call with one scale per row (token), fp32 sums, the two scales applied
  on the way out, a bf16 result: FP8 rowwise, as vLLM's and torchao's dynamic FP8 linears. On a
  GPU with FP8 matmuls (compute capability 8.9 or later: Ada, Hopper) through `torch._scaled_mm`,
  for every matmul whose two dimensions are multiples of 16 (what its kernels require); elsewhere
  (a CPU, an older GPU, other shapes) emulated: the e4m3 values, exact in bf16 and float32,
  multiplied in the copy's dtype and scaled in float32, which is the kernel's maths up to the
  order of its sums, a bf16 copy's rounding of the sum before it is scaled, and a float32 copy's
  result, which the kernel rounds to bf16. The emulation is no faster than the copy itself: on a
  CPU it is there to measure what FP8 sampling does to training before a GPU runs it. The
  fixed-shape decoder of CUDA graphs reads its FP8 weights where they were captured, so
  `Fp8Matmul.update` rewrites them in place. Off by default; not yet run on a GPU.

Where fbgemm is missing (a build without it, an ARM CPU) or misbehaves, 'int8' falls back to
'int8_weight_only''s product. Held to fbgemm's AVX2 kernels (`FBGEMM_ENABLE_INSTRUCTIONS=AVX2`, with
PyTorch's and oneDNN's as on an AVX2 CPU) the same EPYC took 3.0 ms for the LM head against 18 ms in
float32 and halved a float32 decoding step, but the sampler's KL to the policy doubled (7-bit
activations) and `make train`'s recipe scored 4.3 points below float32 over three seeds.

The sampler's log-probs come from the quantized model, so the loss's importance weights against
the sampler (`sampler_is_cap`, `off_policy_mask_threshold`) and the `sampler/*` metrics see the
difference. `quantize_linears` turns a model's `nn.Linear` and GPT-2 `Conv1D` layers into their
quantized kinds in place: they keep their float weights (the generation copy refreshes those, as
before), and take their 8-bit form again whenever a weight changed (`cpu.weights_stamp`).
"""

import functools
import warnings
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from grpo_hf.engine.cpu import BlockedLinear, weights_stamp
from grpo_hf.models.policy import Float32Head

INT8_MAX = 127
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_MIN_SCALE = 1e-12 / FP8_MAX  # a row of zeros still divides by something


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (N, K) int8 q and (N,) float32 scales with weight ~ q * scale[:, None].

    Symmetric, one scale per output channel: max |w_row| / 127, so each row's largest entry maps
    to +-127. An all-zero row gets scale 1 (its q is 0 whatever the scale).
    """
    weight = weight.detach().float()  # (N, K)
    scale = weight.abs().amax(dim=1) / INT8_MAX  # (N,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # (N, K)
    return q, scale


def _prepacked(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fbgemm's packed form of the per-channel int8 weight q * scale."""
    zero_points = torch.zeros(scale.shape, dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated; this one lives only for the packing
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(quantized, None)


def _kernel_product(weight: torch.Tensor, x: torch.Tensor, reduce_range: bool) -> torch.Tensor | None:
    """x @ (q * scale).T on PyTorch's dynamic int8 linear (fbgemm), q and scale `weight` rounded per
    channel; None where the kernel does not run here."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    q, scale = quantize_per_channel(weight)
    try:
        return torch.ops.quantized.linear_dynamic(x, _prepacked(q, scale), reduce_range)
    except (RuntimeError, NotImplementedError):
        return None


@functools.cache
def full_range_activations() -> bool:
    """Whether fbgemm may round activations to all 8 bits here: only where its kernels sum int8
    products in 32 bits (VNNI). Its AVX2 and plain AVX-512 kernels add each pair of u8 x i8 products
    in a saturating 16-bit sum, which 8-bit activations can overflow (255 * 127 * 2 > 32,767); there
    7 bits, as `quantize_dynamic` does. fbgemm picks its kernels from the CPU and from
    `FBGEMM_ENABLE_INSTRUCTIONS`, so this asks the kernel: one product that overflows a 16-bit sum."""
    # Every activation rounds to 255, every weight to 127; the exact product is 64.
    product = _kernel_product(torch.ones(1, 64), torch.ones(1, 64), reduce_range=False)
    return product is not None and torch.allclose(product, torch.full_like(product, 64.0))


@functools.cache
def int8_kernel_supported() -> bool:
    """Whether PyTorch's dynamic int8 linear runs here (x86 fbgemm), checked on one small product
    against the float product of the same rounded weights."""
    weight = torch.linspace(-1, 1, 64).view(8, 8)
    x = torch.linspace(1, -1, 16).view(2, 8)
    product = _kernel_product(weight, x, reduce_range=not full_range_activations())
    q, scale = quantize_per_channel(weight)
    return product is not None and torch.allclose(product, F.linear(x, q.float() * scale[:, None]), atol=0.05)


class Int8Matmul:
    """x (rows, in) -> x @ W.T for a fixed (out, in) weight W held in int8 with per-channel scales,
    x rounded to int8 at each call (`rollout_quantization='int8'`).

    On PyTorch's dynamic int8 linear where it runs (`int8_kernel_supported`); elsewhere x stays as it
    is, multiplied in W's dtype by the dequantized weight (on oneDNN's blocked layout where it can,
    `cpu.BlockedLinear`, sized for `rows`). The result has x's dtype. CPU only.
    """

    rounds_activations = True

    def __init__(self, weight: torch.Tensor, rows: int = 1):
        if weight.device.type != "cpu":
            raise ValueError(
                f"rollout_quantization runs on a CPU; this weight is on {weight.device.type}. Unset "
                "rollout_quantization."
            )
        q, scale = quantize_per_channel(weight)
        self.fast = self.rounds_activations and int8_kernel_supported()
        self.reduce_range = not full_range_activations()  # 7 bits where fbgemm sums in 16 bits
        if self.fast:
            self.weight = _prepacked(q, scale)
        else:
            self.linear = BlockedLinear((q.float() * scale[:, None]).to(weight.dtype), rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast:
            return torch.ops.quantized.linear_dynamic(x.float(), self.weight, self.reduce_range).to(x.dtype)
        return self.linear(x)


class Int8WeightOnlyMatmul(Int8Matmul):
    """x @ W.T with W rounded to int8 per channel and x as it is (`rollout_quantization=
    'int8_weight_only'`): an int8 weight-only sampler's precision, multiplied in W's dtype by the
    dequantized weight, so at the speed of the unquantized copy. PyTorch 2.13's int8 weight-only CPU
    kernel, `aten._weight_int8pack_mm`, took 2 to 4 times as long as the bf16 product on blocked
    weights on decoding's shapes (`bench/int8_kernels.py`), so it is not used."""

    rounds_activations = False


def fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (N, K) float8 e4m3 q and (N,) float32 scales with weight ~ q * scale[:, None].

    One scale per output channel, max |w_row| / 448, so each row's largest entry maps to +-448
    (e4m3's largest); e4m3 then keeps 3 bits of mantissa of each entry. An all-zero row gets
    scale 1."""
    weight = weight.detach().float()  # (N, K)
    scale = weight.abs().amax(dim=1) / FP8_MAX  # (N,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (weight / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) activations -> (M, K) float8 e4m3 and (M, 1) float32 scales, one per row: max |x_row| / 448."""
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=FP8_MIN_SCALE)  # (M, 1)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_kernel_supported(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` multiplies FP8 on `device` at FP8's speed: a CUDA GPU of compute
    capability 8.9 or later. (PyTorch's CPU `_scaled_mm` computes the same as a slow reference, far
    slower than a bf16 product: `Fp8Matmul` emulates it there.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Matmul:
    """x (rows, in) -> x @ W.T for a fixed (out, in) weight W in float8 e4m3 with per-channel scales,
    x rounded to e4m3 per row at each call (`rollout_quantization='fp8'`): `torch._scaled_mm` where
    `fp8_kernel_supported` and both of W's dimensions are multiples of 16, else emulated (the e4m3
    values multiplied in W's dtype, on oneDNN's blocked layout where it can, `cpu.BlockedLinear`,
    sized for `rows` (None: the plain weight), then scaled in float32). The result has x's dtype (the
    kernel's is bf16)."""

    def __init__(self, weight: torch.Tensor, rows: int | None = 1):
        self.rows, self.dtype = rows, weight.dtype
        out_features, in_features = weight.shape
        self.kernel = fp8_kernel_supported(weight.device) and out_features % 16 == 0 and in_features % 16 == 0
        self.update(weight)

    def update(self, weight: torch.Tensor) -> None:
        """Round `weight` (same shape) anew; on the kernel's path into the same memory, where a CUDA
        graph reads it."""
        q, scale = fp8_per_channel(weight)  # (N, K), (N,)
        if not self.kernel:
            self.linear, self.scale = BlockedLinear(q.to(self.dtype), self.rows), scale
        elif hasattr(self, "q"):
            self.q.copy_(q)
            self.scale.copy_(scale.view(1, -1))
        else:
            self.q, self.scale = q, scale.view(1, -1)  # (N, K), (1, N)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What a call reads (a captured graph must be captured again if one of them moved)."""
        return (self.q, self.scale) if self.kernel else (*self.linear.tensors(), self.scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = fp8_rows(x)  # (M, K), (M, 1)
        if self.kernel:
            out = torch._scaled_mm(q, self.q.t(), scale_a=scale, scale_b=self.scale, out_dtype=torch.bfloat16)
            return out.to(x.dtype)  # (M, N)
        return (self.linear(q.to(self.dtype)).float() * scale * self.scale).to(x.dtype)  # (M, N)


class _QuantizedForward:
    """The forward of a quantized layer: its (out, in) weight as its `quantized_matmul`
    (`Int8Matmul`, `Int8WeightOnlyMatmul` or `Fp8Matmul`, set by `quantize_linears`), made again
    when the weight changed, then the bias in float."""

    quantized_matmul: type = Int8Matmul

    def _quantized_product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        stamp = weights_stamp((self.weight,))
        cached = getattr(self, "_quantized", None)
        # A weight that requires grad may be written without a version bump (fused AdamW): rounded anew.
        if cached is None or cached[0] != stamp or self.weight.requires_grad:
            cached = self._quantized = (stamp, self.quantized_matmul(weight))
        out = cached[1](x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)  # (..., out)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class QuantizedLinear(_QuantizedForward, nn.Linear):
    """An `nn.Linear` whose forward multiplies by its quantized weight (`quantized_matmul`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._quantized_product(x, self.weight)


class QuantizedConv1D(_QuantizedForward, Conv1D):
    """GPT-2's `Conv1D` (x @ W + b, W (in, out)) multiplying by its quantized weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._quantized_product(x, self.weight.t())


# By rollout_quantization.
MATMULS = {"int8": Int8Matmul, "int8_weight_only": Int8WeightOnlyMatmul, "fp8": Fp8Matmul}
ROLLOUT_QUANTIZATIONS = tuple(MATMULS)


def quantize_linears(
    model: nn.Module, quantization: str = "int8", only: Collection[str] | None = None
) -> nn.Module:
    """Turn `model`'s `nn.Linear` and `Conv1D` layers into `QuantizedLinear` / `QuantizedConv1D`
    multiplying as `quantization` says (a key of `MATMULS`), in place (same parameters, ties kept).
    A float32 LM head (`cast_lm_head_to_fp32`) stays as it is: it was asked for in float32.
    `only` (names such as 'o_proj', 'lm_head'): just the layers so named, as `bench/int8_kernels.py`
    measures each kind of layer's share of the sampler's error (Llama's decoder multiplies a fused
    q/k/v or gate/up group as its first layer does)."""
    kinds = {nn.Linear: QuantizedLinear, Conv1D: QuantizedConv1D}
    for name, module in model.named_modules():
        kind = kinds.get(type(module))
        chosen = only is None or name.rsplit(".", 1)[-1] in only
        if kind is not None and chosen and not isinstance(module, Float32Head):
            module.__class__ = kind
            module.quantized_matmul = MATMULS[quantization]
    return model


def quantization_of(model: nn.Module) -> str | None:
    """The `rollout_quantization` that `quantize_linears` gave `model` (its decoders then multiply so
    too), or None."""
    kinds = {module.quantized_matmul for module in model.modules() if isinstance(module, _QuantizedForward)}
    return next((name for name, kind in MATMULS.items() if kind in kinds), None)
