"""The padding-free completion pass: its layout by hand, its guards, and its numbers."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_decoding import llama_with_rope_scaling
from test_logprobs import grouped_batch
from tiny_models import tiny_gpt2, tiny_llama, tiny_mistral

from grpo_hf.engine import packing
from grpo_hf.engine.logprobs import (
    completion_logits,
    completion_logps,
    packed_completion_logps,
)
from grpo_hf.engine.packing import PackedRows, can_pack
from grpo_hf.engine.token_scores import token_logps_and_entropy


@pytest.fixture(params=["grouped", "causal-rows"])
def attention(request, monkeypatch):
    """Each loss-pass attention: `grouped_attention` over padded blocks, or SDPA over `CausalRows`."""
    monkeypatch.setattr(packing, "GROUPED_MAX_SCORES", 10**12 if request.param == "grouped" else -1)
    return request.param


def test_layout_of_two_rows_by_hand():
    prompt_real = torch.tensor([[0, 1], [1, 1]]).bool()  # (U, P) = (2, 2): prompt 0 left-padded
    completion_real = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()  # (B, C) = (2, 3): 3 real tokens
    rows = PackedRows(prompt_real, torch.tensor([0, 1]), completion_real)
    assert rows.causal is None  # short: padded blocks
    assert rows.prompts.flat_index.tolist() == [1, 2, 3]  # row * P + column
    assert rows.completions.flat_index.tolist() == [0, 1, 3]  # row * C + column
    # Prompts: causal over real tokens; a padding query sees only itself (no empty softmax row).
    assert (rows.prompt_bias[:, 0] == 0).int().tolist() == [[[1, 0], [0, 1]], [[1, 0], [1, 1]]]
    # Completions: the row's prompt, then its own tokens up to the query; padding queries also see themselves.
    assert (rows.completion_bias[0, 0] == 0).int().tolist() == [
        [0, 1, 1, 0, 0],
        [0, 1, 1, 1, 0],
        [0, 1, 1, 1, 1],
    ]
    assert (rows.completion_bias[1, 0] == 0).int().tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 1],
    ]
    packed = torch.tensor([10.0, 11.0, 20.0]).view(1, 1, 3, 1)  # (1, H, n, d)
    padded = rows.completions.pad(packed)  # (B, H, C, d)
    assert padded.view(2, 3).tolist() == [[10.0, 11.0, 0.0], [20.0, 0.0, 0.0]]
    assert rows.completions.unpad(padded).view(-1).tolist() == [10.0, 11.0, 20.0]  # (1, n, H, d)


def test_causal_rows_by_hand(monkeypatch):
    """Each completion row is its prompt's real tokens, its own, then padding read from token 0."""
    monkeypatch.setattr(packing, "GROUPED_MAX_SCORES", -1)
    prompt_real = torch.tensor([[0, 1], [1, 1]]).bool()  # packed tokens 0 and 1, 2
    completion_real = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]).bool()  # tokens 3, 4 | 5 | 6, 7, 8
    rows = PackedRows(prompt_real, torch.tensor([0, 1, 1]), completion_real).causal
    assert rows.width == 5  # prompt 1 (2 tokens) + completion 2 (3 tokens)
    assert rows.gather.view(3, 5).tolist() == [[0, 3, 4, 0, 0], [1, 2, 5, 0, 0], [1, 2, 6, 7, 8]]
    # Prompt tokens come back from the first row of their prompt, completion tokens from their own.
    assert rows.scatter.tolist() == [0, 5, 6, 1, 2, 7, 12, 13, 14]
    packed = torch.arange(9.0).view(1, 1, 9, 1)  # (1, H, n, d)
    assert rows.packed(rows.rows(packed)).view(-1).tolist() == list(range(9))


def test_which_models_pack():
    assert can_pack(tiny_llama()) and can_pack(tiny_gpt2())
    assert not can_pack(tiny_mistral())  # a sliding window: attention depends on the layout
    wrapper = torch.nn.Module()
    wrapper.module = tiny_llama()  # as DDP and DeepSpeed hold the model
    assert can_pack(wrapper)


@pytest.mark.parametrize(
    "build", [tiny_llama, llama_with_rope_scaling, tiny_gpt2], ids=["llama", "llama3-rope-gqa", "gpt2"]
)
def test_packed_pass_matches_the_padded_one(build, attention):
    model = build().eval()
    ids, mask, width = grouped_batch()  # completions of 4, 2 and 1 tokens
    real = mask[:, -width:].bool()
    packed_logps, packed_entropy, _ = packed_completion_logps(model, ids, mask, width, 0.8, with_entropy=True)
    logits = completion_logits(model, ids, mask, width)  # (B, C, V), padding run through the model
    logps, entropy, _ = token_logps_and_entropy(logits, ids[:, -width:], 0.8, with_entropy=True)
    torch.testing.assert_close(packed_logps[real], logps[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_entropy[real], entropy[real], rtol=1e-5, atol=1e-5)
    assert (packed_logps[~real] == 0).all() and (packed_entropy[~real] == 0).all()


@pytest.mark.parametrize("build", [tiny_llama, llama_with_rope_scaling], ids=["llama", "llama3-rope-gqa"])
def test_packed_pass_under_bf16_autocast_is_as_close_to_float32_as_the_padded_one(build, attention):
    model = build().eval()
    ids, mask, width = grouped_batch()
    real = mask[:, -width:].bool()
    with torch.no_grad():
        exact, _, _ = packed_completion_logps(model, ids, mask, width)  # float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            packed, _, _ = packed_completion_logps(model, ids, mask, width)
            logits = completion_logits(model, ids, mask, width)  # transformers' SDPA attention in bf16
            padded, _, _ = token_logps_and_entropy(logits, ids[:, -width:])
    packed_error, padded_error = ((x - exact)[real].abs().max() for x in (packed, padded))
    assert packed_error > 0  # bf16 really was used
    # Measured: 0.0011 vs 0.0009 (llama), 0.043 vs 0.047 (wide weights); attention here is in float32.
    assert packed_error <= 2 * padded_error


def test_completions_with_holes_are_refused():
    model = tiny_llama().eval()
    ids, mask, width = grouped_batch()
    mask[1, -width:] = torch.tensor([1, 0, 1, 0])
    with pytest.raises(ValueError, match="right padding"):
        packed_completion_logps(model, ids, mask, width)


def test_attention_that_never_reaches_the_packed_kernel_raises():
    """A model whose attention reads another config would attend across packed rows: refuse."""
    model = tiny_llama().eval()
    for layer in model.model.layers:
        layer.self_attn.config = copy.copy(model.config)  # the swap no longer reaches attention
    ids, mask, width = grouped_batch()
    with pytest.raises(RuntimeError, match="attention interface"):
        packed_completion_logps(model, ids, mask, width)
    assert model.config._attn_implementation != packing.PACKED_ATTENTION  # restored after the error


def test_models_that_cannot_pack_take_the_padded_pass():
    model = tiny_mistral().eval()
    ids, mask, width = grouped_batch()
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    try:
        shared, _, _ = completion_logps(model, ids, mask, width)
    finally:
        hook.remove()
    assert seen == [torch.Size([2, 5]), torch.Size([6, 4])]  # prompts once, then padded completions
    whole, _, _ = completion_logps(model, ids, mask, width, gradient_checkpointing=True)
    real = mask[:, -width:].bool()
    torch.testing.assert_close(shared[real], whole[real], rtol=1e-5, atol=1e-5)


def policy(build, tuning: str) -> torch.nn.Module:
    """A tiny model with LoRA (frozen LM head) or fully trainable, random LoRA weights so they matter."""
    torch.manual_seed(0)
    model = build().eval()
    if tuning == "full":
        return model
    targets = ["q_proj", "v_proj"] if build is tiny_llama else ["c_attn"]
    return get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))


def logps_and_grads(model, run) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs and entropy of `run(model)` and the gradients of a weighted sum of both."""
    model.zero_grad()
    ids, mask, width = grouped_batch()
    real = mask[:, -width:]
    logps, entropy, _ = run(model, ids, mask, width)
    weights = real * torch.arange(1, width + 1)  # (B, C) a different gradient for every token
    (logps * weights).sum().add((entropy * weights).sum() * 0.1).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logps.detach() * real, entropy.detach() * real, grads


def padded(model, ids, mask, width):
    """The plain transformers forward of every row whole, the model's own head, then the log-softmax."""
    logits = completion_logits(model, ids, mask, width, share_prompts=False)  # (B, C, V)
    return token_logps_and_entropy(logits, ids[:, -width:], 0.9, with_entropy=True)


@pytest.mark.parametrize("tuning", ["lora", "full"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_packed_logps_and_gradients_match_the_padded_forward(build, tuning, attention):
    """Log-probs, entropy and every gradient, with the LM head fused (recomputed in backward when
    it trains or the entropy needs a gradient) and the chosen attention, against transformers."""
    model = policy(build, tuning)
    head = model.get_output_embeddings()
    calls = []
    head.register_forward_hook(lambda *args: calls.append(1))
    packed = lambda *args: completion_logps(*args, 0.9, with_entropy=True)  # noqa: E731
    logps, entropy, grads = logps_and_grads(model, packed)
    assert not calls and model.get_output_embeddings() is head  # fused, and put back after the call
    exact_logps, exact_entropy, exact_grads = logps_and_grads(model, padded)
    torch.testing.assert_close(logps, exact_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, exact_entropy, rtol=1e-5, atol=1e-5)
    assert grads.keys() == exact_grads.keys() and len(grads) >= 4
    if tuning == "full":
        assert head.weight.grad is not None
    for name in grads:
        torch.testing.assert_close(grads[name], exact_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_frozen_head_without_entropy_gradient_gives_the_recomputed_logps_and_gradients(build):
    """The frozen head's two fused paths: gradient directions taken in forward, or recomputed."""
    model = policy(build, "lora")
    results = []
    for entropy_grad in (True, False):
        model.zero_grad()
        ids, mask, width = grouped_batch()
        logps, entropy, _ = completion_logps(
            model, ids, mask, width, 0.9, with_entropy=True, entropy_grad=entropy_grad
        )
        assert entropy.requires_grad == entropy_grad
        (logps * mask[:, -width:] * torch.arange(1, width + 1)).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach(), entropy.detach(), grads))
    (logps, entropy, grads), (fused_logps, fused_entropy, fused_grads) = results
    torch.testing.assert_close(fused_logps, logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_entropy, entropy, rtol=1e-6, atol=1e-6)
    assert grads.keys() == fused_grads.keys() and len(grads) >= 4
    for name in grads:
        torch.testing.assert_close(fused_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fused_head_is_put_back_when_the_forward_fails():
    model = tiny_llama().eval().requires_grad_(False)
    head = model.lm_head
    ids, mask, width = grouped_batch()
    model.model.layers[1].mlp.register_forward_hook(lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        completion_logps(model, ids, mask, width, entropy_grad=False)
    assert model.lm_head is head


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_gradient_checkpointing_recomputes_with_packed_attention(tuning, attention):
    """Checkpointed layers recompute in backward through the packed attention: same numbers."""
    model = policy(tiny_llama, tuning).train()
    packed = lambda *args: completion_logps(*args, 0.9, with_entropy=True)  # noqa: E731
    plain_logps, plain_entropy, plain_grads = logps_and_grads(model, packed)
    model.gradient_checkpointing_enable()  # transformers' default: non-reentrant checkpoints
    calls = []
    original = packing.packed_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    packing.AttentionInterface.register(packing.PACKED_ATTENTION, counted)
    try:
        logps, entropy, grads = logps_and_grads(model, packed)
    finally:
        packing.AttentionInterface.register(packing.PACKED_ATTENTION, original)
    layers = (
        model.config.num_hidden_layers
        if tuning == "full"
        else model.base_model.model.config.num_hidden_layers
    )
    assert len(calls) == 2 * layers  # every layer once forward, once recomputed in backward
    torch.testing.assert_close(logps, plain_logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, plain_entropy, rtol=1e-6, atol=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_reentrant_checkpoints_take_the_padded_pass():
    """A reentrant checkpoint cannot be given the packed attention for its recompute."""
    model = tiny_llama().train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    assert can_pack(model)
    model.gradient_checkpointing_enable({"use_reentrant": True})
    assert not can_pack(model)
