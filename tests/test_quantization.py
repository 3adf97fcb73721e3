"""Int8 rollouts (`rollout_quantization='int8'`): per-channel rounding, the int8 decoders against the
float ones, the quantized copy following the policy, and where the setting is refused."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_decoding import llama_with_rope_scaling, prompts
from tiny_models import tiny_gpt2, tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, length_reward, make_config

from grpo_hf import GRPOTrainer
from grpo_hf.engine import quantization
from grpo_hf.engine.decoding import LlamaDecoder, decoder_for
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.model_forward import TransformersDecoder
from grpo_hf.engine.quantization import (
    Int8Matmul,
    Int8WeightOnlyMatmul,
    QuantizedLinear,
    quantize_linears,
    quantize_per_channel,
)


@pytest.fixture(params=["kernel", "fallback"])
def int8_path(request, monkeypatch) -> str:
    """Each test twice: on PyTorch's int8 kernel where this CPU runs it, and on the dequantized
    fallback (`Int8Matmul` when the kernel is missing)."""
    if request.param == "fallback":
        monkeypatch.setattr(quantization, "int8_kernel_supported", lambda: False)
    elif not quantization.int8_kernel_supported():
        pytest.skip("PyTorch's int8 kernel (fbgemm) does not run here")
    return request.param


def test_per_channel_scales_by_hand():
    weight = torch.tensor([[1.27, -0.64, 0.004], [0.0, 0.0, 0.0], [-2.54, 1.0, 0.02]])
    q, scale = quantize_per_channel(weight)
    # Row 0: max 1.27 -> scale 0.01; -0.64 / 0.01 = -64; 0.004 / 0.01 = 0.4 rounds to 0.
    # Row 1: all zero -> scale 1, q 0. Row 2: max 2.54 -> scale 0.02; 1.0 / 0.02 = 50; 0.02 -> 1.
    torch.testing.assert_close(scale, torch.tensor([0.01, 1.0, 0.02]))
    assert q.dtype == torch.int8
    assert q.tolist() == [[127, -64, 0], [0, 0, 0], [-127, 50, 1]]


@pytest.mark.parametrize(
    "only",
    [None, ("o_proj",), ("gate_proj", "up_proj", "lm_head"), ("q_proj", "k_proj", "v_proj", "down_proj")],
)
@torch.no_grad()
def test_weight_only_decodes_as_the_float_model_on_rounded_weights(only):
    """'int8_weight_only' is the float decoder on weights rounded per channel, nothing else: the same
    logits as a float copy whose every matmul weight (or those of the layers named in `only`, and
    none other) was replaced by q * scale, at every step."""
    model = llama_with_rope_scaling().eval().requires_grad_(False)
    quantized = quantize_linears(copy.deepcopy(model), "int8_weight_only", only=only)
    rounded = copy.deepcopy(model)
    for name, module in rounded.named_modules():
        if type(module) is torch.nn.Linear and (only is None or name.rsplit(".", 1)[-1] in only):
            q, scale = quantize_per_channel(module.weight)
            module.weight = torch.nn.Parameter(q.float() * scale[:, None], requires_grad=False)
    ids, mask = prompts()
    for build in (lambda m: LlamaDecoder(m, 4), TransformersDecoder):
        ours, theirs = build(quantized), build(rounded)
        torch.testing.assert_close(ours.prefill(ids, mask), theirs.prefill(ids, mask), rtol=1e-5, atol=1e-5)
        token = torch.tensor([5, 6, 7, 8])
        torch.testing.assert_close(ours(token), theirs(token), rtol=1e-5, atol=1e-5)
    unrounded = LlamaDecoder(model, 4).prefill(ids, mask)
    assert not torch.allclose(LlamaDecoder(quantized, 4).prefill(ids, mask), unrounded, atol=1e-3)


def test_int8_matmul_multiplies_by_the_rounded_weight(int8_path):
    """Both paths give x @ (q * scale).T: exactly up to float rounding where activations stay float
    (fallback), within the activations' rounding error on the kernel (7 or 8 bits)."""
    torch.manual_seed(0)
    weight, x = torch.randn(40, 24), torch.randn(5, 24)
    q, scale = quantize_per_channel(weight)
    expected = x @ (q.float() * scale[:, None]).T  # (5, 40)
    got = Int8Matmul(weight)(x)
    assert got.shape == (5, 40) and got.dtype == torch.float32
    # The kernel rounds x to 7 bits over its range (2 max|x| / 127 per step): here at most ~1% of
    # the product's largest entry.
    tolerance = 1e-5 if int8_path == "fallback" else 0.015 * expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)
    torch.testing.assert_close(Int8WeightOnlyMatmul(weight)(x), expected, rtol=0, atol=1e-5)  # x as it is
    assert Int8Matmul(weight.bfloat16())(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("vnni", [True, False])
def test_activations_take_all_8_bits_only_where_the_cpu_has_vnni(monkeypatch, vnni):
    """Without VNNI (AVX2) fbgemm's 8-bit products can saturate its 16-bit sums: 7-bit activations there,
    as quantize_dynamic does; with VNNI the sums are 32-bit and the activations take all 8 bits."""
    monkeypatch.setattr(quantization, "full_range_activations", lambda: vnni)
    assert Int8Matmul(torch.randn(8, 8)).reduce_range is (not vnni)


KERNEL_CHOICE = """
import json, torch
from grpo_hf.engine.quantization import Int8Matmul, full_range_activations
product = Int8Matmul(torch.ones(4, 64))(torch.ones(2, 64))
print(json.dumps({"full_range": full_range_activations(), "product": product.unique().tolist()}))
"""


@pytest.mark.skipif(
    not quantization.int8_kernel_supported(), reason="PyTorch's int8 kernel (fbgemm) does not run here"
)
@pytest.mark.parametrize("isa", [None, "AVX2"])
def test_8_bit_activations_only_where_fbgemm_sums_in_32_bits(isa):
    """A row of 64 ones times a weight of ones is 64. Rounded to 8 bits, each activation is 255 and each
    weight 127: fbgemm's AVX2 kernels add pairs of products in 16 bits (255 * 127 * 2 > 32,767) and
    gave 32.4 for it here, so there the activations take 7 bits. Held to AVX2 kernels by
    FBGEMM_ENABLE_INSTRUCTIONS (as on an AVX2 CPU) the choice follows the kernels, not the CPU's
    own VNNI; left to the CPU, all 8 bits exactly where it has VNNI."""
    env = {key: value for key, value in os.environ.items() if key != "FBGEMM_ENABLE_INSTRUCTIONS"}
    if isa:
        env["FBGEMM_ENABLE_INSTRUCTIONS"] = isa
    run = subprocess.run(
        [sys.executable, "-c", KERNEL_CHOICE], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["full_range"] is (torch.cpu._is_vnni_supported() if isa is None else False)
    assert result["product"] == [64.0]


@pytest.mark.skipif(
    not (torch.cpu._is_vnni_supported() and quantization.int8_kernel_supported()),
    reason="needs VNNI and fbgemm",
)
def test_all_8_bits_halve_the_activations_rounding_error():
    """On the kernel, the same product with 8-bit activations is about twice as close to the float product
    of the rounded weights as with 7 bits (the rounding step halves)."""
    torch.manual_seed(0)
    weight, x = torch.randn(256, 128), torch.randn(16, 128)
    q, scale = quantize_per_channel(weight)
    expected = x @ (q.float() * scale[:, None]).T
    matmul = Int8Matmul(weight)
    errors = {}
    for reduce_range in (True, False):
        matmul.reduce_range = reduce_range
        errors[reduce_range] = (matmul(x) - expected).abs().mean().item()
    assert 1.5 < errors[True] / errors[False] < 2.5


@pytest.mark.parametrize("build", [tiny_llama, llama_with_rope_scaling], ids=["llama", "llama3-rope-gqa"])
@torch.no_grad()
def test_int8_llama_decoder_logits_against_the_float_decoder(build, int8_path):
    """The int8 copy's logits, prefill and every step, within 15% of the float logits' largest
    magnitude (on llama3-rope-gqa's weights drawn 10x wider than usual; 3% at the usual init).
    The same int8 model through transformers' forward gives the same prefill logits where no
    prompt is padded (padding joins a call's activation range, which the decoders fill differently)."""
    model = build().eval().requires_grad_(False)
    quantized = quantize_linears(copy.deepcopy(model))
    ids, mask = prompts()
    bound = 0.03 if build is tiny_llama else 0.15
    floats, int8 = LlamaDecoder(model, 8), LlamaDecoder(quantized, 8)
    expected, got = floats.prefill(ids, mask), int8.prefill(ids, mask)
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        error = (got - expected).abs().max().item()
        assert 0 < error <= bound * expected.abs().max().item(), error
        token = torch.randint(3, 259, (4,), generator=generator)
        expected, got = floats(token), int8(token)
    whole = ids[:2, 2:], mask[:2, 2:]  # two copies of one prompt, unpadded
    forward = TransformersDecoder(quantized).prefill(*whole)
    torch.testing.assert_close(LlamaDecoder(quantized, 2).prefill(*whole), forward, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_gpt2_conv1d_layers_decode_in_int8_through_the_models_forward(int8_path):
    model = tiny_gpt2().eval().requires_grad_(False)
    quantized = quantize_linears(copy.deepcopy(model))
    assert isinstance(quantized.transformer.h[0].attn.c_attn, quantization.QuantizedConv1D)
    ids, mask = prompts()
    expected = TransformersDecoder(model).prefill(ids, mask)
    got = decoder_for(quantized, 4).prefill(ids, mask)
    error = (got - expected).abs().max().item()
    assert 0 < error <= 0.03 * expected.abs().max().item(), error


def lora_policy() -> torch.nn.Module:
    policy = get_peft_model(
        tiny_llama().eval(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # trained adapters
    return policy


@torch.no_grad()
def test_lora_is_merged_before_the_weights_are_rounded(int8_path):
    policy = lora_policy()
    ids, mask = prompts()
    got = LlamaDecoder(GenerationCopy(policy, torch.float32, quantization="int8").model, 2).prefill(ids, mask)
    merged = quantize_linears(copy.deepcopy(policy).merge_and_unload())
    torch.testing.assert_close(got, LlamaDecoder(merged, 2).prefill(ids, mask), rtol=0, atol=0)
    base_only = quantize_linears(copy.deepcopy(policy.get_base_model()))
    with policy.disable_adapter():
        assert not torch.allclose(got, LlamaDecoder(base_only, 2).prefill(ids, mask), atol=1e-3)


def test_refresh_after_an_optimizer_step_rounds_the_new_weights(int8_path):
    """After a step and `refresh`, both decoders sample from the new weights in int8: the same logits
    as a copy made from the stepped policy."""
    policy = lora_policy()
    generation = GenerationCopy(policy, torch.float32, quantization="int8")
    ids, mask = prompts()
    decoders = (LlamaDecoder, lambda model, _: TransformersDecoder(model))
    with torch.no_grad():
        before = [decoder(generation.model, 2).prefill(ids, mask) for decoder in decoders]
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    policy(input_ids=ids, attention_mask=mask).logits.pow(2).mean().backward()
    optimizer.step()
    model = generation.refresh()
    fresh = GenerationCopy(policy, torch.float32, quantization="int8").model
    with torch.no_grad():
        for decoder, stale in zip(decoders, before, strict=True):
            after = decoder(model, 2).prefill(ids, mask)
            assert not torch.allclose(after, stale, atol=1e-4)
            torch.testing.assert_close(after, decoder(fresh, 2).prefill(ids, mask), rtol=0, atol=0)


def test_a_float32_lm_head_stays_float():
    model = tiny_llama()
    model.lm_head = quantization.Float32Head(32, 259, bias=False)
    quantize_linears(model)
    assert type(model.lm_head) is quantization.Float32Head
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(use_vllm=True, vllm_mode="server"), "vllm_engine_kwargs"),
        (dict(generation_backend="llama_static"), "generation_backend"),
    ],
)
def test_settings_int8_rollouts_cannot_run_with_are_refused(tmp_path, overrides, named):
    for kind in ("int8", "int8_weight_only"):  # on a CPU (on a GPU the device is refused first)
        with pytest.raises(ValueError, match=named):
            make_config(tmp_path, rollout_quantization=kind, use_cpu=True, **overrides)
    with pytest.raises(ValueError, match="rollout_quantization"):
        make_config(tmp_path, rollout_quantization="fp4")


def test_int8_rollouts_are_refused_on_a_gpu(tmp_path, monkeypatch):
    args = make_config(tmp_path, rollout_quantization="int8", use_cpu=True)
    args.use_cpu = False  # as a run on a GPU (TrainingArguments would place itself on it if built so here)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="trains on a GPU: use rollout_quantization=.fp8."):
        args._check_rollout_quantization()


@pytest.mark.parametrize("kind", ["int8", "int8_weight_only"])
def test_training_samples_from_the_int8_copy_and_logs_the_mismatch(tmp_path, int8_path, kind):
    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, rollout_quantization=kind, max_steps=1, use_cpu=True),  # CPU only
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    layer = trainer.generator.copy.model.model.layers[0].self_attn.q_proj
    assert layer.quantized_matmul is quantization.MATMULS[kind]
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["sampling/sampling_logp_difference/max"] > 0  # int8 sampler != float policy
