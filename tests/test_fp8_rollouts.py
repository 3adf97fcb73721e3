"""FP8 rollouts (`rollout_quantization='fp8'`): e4m3 rounding and a product by hand, the emulated
product against PyTorch's `_scaled_mm`, the FP8 weights of the fixed-shape decoder rewritten in
place (a CUDA graph reads them where it was captured), and where the setting runs. The `cuda`
tests run the kernel itself; on a CPU `cpu_kernel` puts PyTorch's CPU `_scaled_mm` (its reference
of the GPU kernel's maths, slow) in the emulation's place."""

import copy

import pytest
import torch
from test_fixed_shape import (
    DEVICES,
    assert_same_rollout,
    check_refreshed_weights_reach_the_replay,
    compiled_as_static,
    compiled_replay_and_eager,
    decode_both,
    lora_policy,
    prompts,
    sampling,
    train_q_adapter,
)
from tiny_models import tiny_gpt2, tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, length_reward, make_config

from grpo_hf import GRPOTrainer
from grpo_hf.engine import fixed_shape, quantization
from grpo_hf.engine.decoding import LlamaDecoder, decoder_for
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.model_forward import StaticForwardDecoder, TransformersDecoder
from grpo_hf.engine.quantization import Fp8Matmul, fp8_per_channel, fp8_rows, quantize_linears


@pytest.fixture
def cpu_kernel(monkeypatch):
    """`Fp8Matmul` on `torch._scaled_mm` wherever the shape allows, the CPU included."""
    monkeypatch.setattr(quantization, "fp8_kernel_supported", lambda device: True)


def test_fp8_rounding_by_hand():
    weight = torch.tensor([[1.0, -0.5, 0.3], [0.0, 0.0, 0.0], [-2.0, 0.01, 1.1]])
    q, scale = fp8_per_channel(weight)
    # Row 0: max 1 -> scale 1/448: 1 -> 448, -0.5 -> -224, 0.3 -> 134.4, between e4m3's 128 and 144
    # (steps of 16 in [128, 256)): 128. Row 1: all zero -> scale 1, q 0. Row 2: max 2 -> scale 2/448:
    # 0.01 -> 2.24, steps of 0.25 in [2, 4): 2.25; 1.1 -> 246.4: 240.
    torch.testing.assert_close(scale * 448, torch.tensor([1.0, 448.0, 2.0]))
    assert q.dtype == torch.float8_e4m3fn
    assert q.float().tolist() == [[448, -224, 128], [0, 0, 0], [-448, 2.25, 240]]
    x, x_scale = fp8_rows(torch.tensor([[2.0, 1.0, -0.7], [0.0, 0.0, 0.0]]))
    # Row 0: max 2 -> scale 2/448: -0.7 -> -156.8: -160. A row of zeros keeps a tiny scale, and its 0s.
    assert x.float().tolist() == [[448, 224, -160], [0, 0, 0]]
    assert x_scale[0].item() == pytest.approx(2 / 448) and 0 < x_scale[1].item() < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_product_by_hand(dtype):
    """The rounded values above: (448 * 448 - 224 * 224 - 160 * 128) * (2 / 448) * (1 / 448) = 130,048
    / 100,352 = 1.29592 (-0.7 and 0.3 are not bf16 numbers, but round to the same e4m3 values)."""
    out = Fp8Matmul(torch.tensor([[1.0, -0.5, 0.3]], dtype=dtype))(
        torch.tensor([[2.0, 1.0, -0.7]], dtype=dtype)
    )
    assert out.dtype == dtype
    assert out.item() == pytest.approx(130_048 / 100_352, rel=2**-8 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_emulation_is_the_kernels_product(dtype, monkeypatch):
    """PyTorch's `_scaled_mm` (here its CPU version) against the emulation on the same weights: equal
    to the bf16 rounding of the kernel's result (a float32 copy's emulation does not round it; a
    bf16 copy's rounds its sum before scaling). A shape the kernel refuses is emulated."""
    torch.manual_seed(0)
    weight, x = torch.randn(48, 64, dtype=dtype), torch.randn(16, 64, dtype=dtype)
    emulated = Fp8Matmul(weight)
    monkeypatch.setattr(quantization, "fp8_kernel_supported", lambda device: True)
    kernel = Fp8Matmul(weight)
    assert kernel.kernel and not emulated.kernel
    torch.testing.assert_close(emulated(x).float(), kernel(x).float(), rtol=2**-7, atol=1e-5)
    assert not Fp8Matmul(torch.randn(259, 64)).kernel  # 259 output channels: not a multiple of 16


def test_update_rewrites_the_kernels_weights_in_place(cpu_kernel):
    torch.manual_seed(0)
    matmul = Fp8Matmul(torch.randn(32, 16))
    pointers = [tensor.data_ptr() for tensor in matmul.tensors()]
    new = torch.randn(32, 16) * 3
    matmul.update(new)
    assert [tensor.data_ptr() for tensor in matmul.tensors()] == pointers
    x = torch.randn(4, 16)
    torch.testing.assert_close(matmul(x), Fp8Matmul(new)(x), rtol=0, atol=0)


@torch.no_grad()
def test_fp8_decoders_agree_and_stay_near_the_float_model():
    """The FP8 copy's prefill logits through `LlamaDecoder` (q/k/v and gate/up fused) and through
    transformers' forward (each layer alone) agree: each row and each output channel has its own
    scale, so neither the fusion nor the padded rows change what a row computes. Both differ from
    the float model's, by at most 5% of its largest logit."""
    model = tiny_llama().eval().requires_grad_(False)
    fp8 = quantize_linears(copy.deepcopy(model), "fp8")
    ids, mask = prompts()
    expected = LlamaDecoder(model, 4).prefill(ids, mask)
    got = LlamaDecoder(fp8, 4).prefill(ids, mask)
    torch.testing.assert_close(got, TransformersDecoder(fp8).prefill(ids, mask), rtol=1e-4, atol=1e-4)
    error = (got - expected).abs().max().item()
    assert 0 < error <= 0.05 * expected.abs().max().item(), error


def test_the_fixed_shape_decoder_samples_the_loops_fp8_tokens():
    policy = lora_policy()
    loop, fixed = decode_both(GenerationCopy(policy, torch.float32, quantization="fp8").refresh(),
                              sampling(top_k=50), *prompts(), seed=3)  # fmt: skip
    assert_same_rollout(fixed, loop)
    floats, _ = decode_both(
        GenerationCopy(policy, torch.float32).refresh(), sampling(top_k=50), *prompts(), seed=3
    )
    assert not torch.equal(floats.sampler_logps, loop.sampler_logps)  # the FP8 copy is another sampler


@pytest.mark.parametrize("device", DEVICES)
def test_refreshed_fp8_weights_reach_the_replayed_step_in_place(device, request):
    """A LoRA Llama's FP8 copy, one kind of adapter moved per round, on the kernel's path (the CPU's
    `_scaled_mm` here): the replayed step's tokens follow the new weights, and the step is captured
    once, as its FP8 weights are rewritten where the capture reads them."""
    if device == "cpu":
        request.getfixturevalue("cpu_kernel")
        captures = request.getfixturevalue("eager_graphs")
    moved = ("q_proj", "o_proj", "gate_proj", "down_proj")
    check_refreshed_weights_reach_the_replay(
        lora_policy().to(device), device, ("llama", "llama_static"), moved, quantization="fp8"
    )
    if device == "cpu":
        assert captures.captures == 1


@pytest.mark.parametrize("kernel", [False, True], ids=["emulated", "scaled_mm"])
def test_the_compiled_fp8_step_is_the_static_step(kernel, inductor_compile, eager_graphs, request):
    """'llama_compiled' on a LoRA policy's FP8 copy, through inductor: the static step's tokens and
    log-probs, round after round, and each round's refreshed weights reach the one compiled step
    (the same seed samples other log-probs). Emulated (on the plain e4m3 weights: inductor lowers
    oneDNN's packed product only where the weight is a constant) and on PyTorch's CPU `_scaled_mm`,
    the GPU kernel's path. The kernel's weights are rewritten in place, so each step is captured
    once; the emulation's move with q_proj's (captured again each round)."""
    if kernel:
        request.getfixturevalue("cpu_kernel")
    policy = lora_policy()
    generation = GenerationCopy(policy, torch.float32, quantization="fp8")
    ids, mask = prompts()
    previous = None
    for _ in range(3):
        train_q_adapter(policy, generation)
        compiled = compiled_as_static(generation.model, ids, mask, seed=0)
        assert previous is None or not torch.equal(compiled.sampler_logps, previous.sampler_logps)
        previous = compiled
    assert inductor_compile.frame_count == 1
    assert eager_graphs.captures == (2 if kernel else 2 * 3)


@pytest.mark.cuda
def test_the_compiled_fp8_step_replays_as_a_cuda_graph():
    """On the GPU's FP8 matmuls (the LM head of 259 tokens emulated: not a multiple of 16), the
    compiled step's replay gives the tokens of the uncompiled steps run eagerly, round after round."""
    policy = lora_policy().to("cuda")
    generation = GenerationCopy(policy, torch.bfloat16, quantization="fp8")
    if not quantization.fp8_kernel_supported(torch.device("cuda")):
        pytest.skip("this GPU has no FP8 matmuls")
    for seed, width in enumerate((7, 20)):
        train_q_adapter(policy, generation)
        replayed, eager = compiled_replay_and_eager(generation.model, width, seed)
        assert torch.equal(replayed.completion_ids, eager.completion_ids)


def test_auto_decodes_a_quantized_models_forward_without_cuda_graphs(monkeypatch):
    """Where steps are captured (as on a GPU), 'auto' takes the fixed-shape decoder of a model's
    own forward, but not for a quantized model, whose layers round their weights into new memory;
    'transformers_static' refuses it."""
    monkeypatch.setattr(fixed_shape, "graphs_enabled", lambda device: True)
    model = tiny_gpt2().eval()
    assert isinstance(decoder_for(model, 4), StaticForwardDecoder)
    quantize_linears(model, "fp8")
    assert type(decoder_for(model, 4)) is TransformersDecoder
    with pytest.raises(ValueError, match="does not decode rollout_quantization='fp8'"):
        decoder_for(model, 4, "transformers_static")


def test_fp8_decodes_in_the_static_llama_decoders_too(tmp_path):
    for backend in ("auto", "llama", "llama_static", "llama_compiled", "transformers"):
        make_config(tmp_path, rollout_quantization="fp8", use_cpu=True, generation_backend=backend)
    with pytest.raises(
        ValueError, match="generation_backend in .*'llama_compiled'.*not 'transformers_static'"
    ):
        make_config(
            tmp_path, rollout_quantization="fp8", use_cpu=True, generation_backend="transformers_static"
        )


@pytest.mark.parametrize("capability, error", [((8, 0), "compute capability 8.9 or later.*this one is 8.0"),
                                               ((9, 0), None)])  # fmt: skip
def test_fp8_on_a_gpu_needs_one_that_multiplies_fp8(tmp_path, monkeypatch, capability, error):
    args = make_config(tmp_path, rollout_quantization="fp8", use_cpu=True)
    args.use_cpu = False  # as a run on a GPU (TrainingArguments would place itself on it if built so here)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if error is None:
        args._check_rollout_quantization()
    else:
        with pytest.raises(ValueError, match=error):
            args._check_rollout_quantization()


def test_training_samples_from_the_fp8_copy_and_logs_the_mismatch(tmp_path):
    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, rollout_quantization="fp8", max_steps=1, use_cpu=True),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    layer = trainer.generator.copy.model.model.layers[0].self_attn.q_proj
    assert layer.quantized_matmul is Fp8Matmul
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["sampling/sampling_logp_difference/max"] > 0  # the FP8 sampler != the float policy
    assert logged["sampler/kl"] > 0
