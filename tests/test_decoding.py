"""The Llama decoding step against transformers' own forward, step by step."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_gpt2, tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_hf.engine import cpu
from grpo_hf.engine.decoding import LlamaDecoder, decoder_for, is_plain_llama
from grpo_hf.engine.model_forward import TransformersDecoder


def llama_with_rope_scaling() -> LlamaForCausalLM:
    """Grouped queries (6 heads over 2), an explicit head_dim, and Llama-3 RoPE scaling.

    Weights drawn 10x wider than usual, so that a small slip anywhere moves the logits visibly.
    """
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    return LlamaForCausalLM(config)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Four left-padded rows: two copies of one prompt, a shorter one, a one-token one."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [0, 0, 5, 6, 7], [0, 9, 8, 7, 6], [0, 0, 0, 0, 4]])
    return ids, (ids != 0).long()


@pytest.fixture(params=["machine", "plain"])
def matmuls(request, monkeypatch) -> str:
    """Each decoder test twice: with the matmuls this CPU supports, and with the plain fallback forced."""
    if request.param == "plain":
        monkeypatch.setattr(cpu, "blocked_matmul_supported", lambda dtype: False)
    return request.param


def decoders(model, ids, mask, steps):
    """Ours and transformers' decoders after the same prefill, whose logits must agree too."""
    ours, theirs = LlamaDecoder(model, steps), TransformersDecoder(model)
    first_ours, first_theirs = ours.prefill(ids, mask), theirs.prefill(ids, mask)
    return ours, theirs, first_ours, first_theirs


@pytest.mark.parametrize("build", [tiny_llama, llama_with_rope_scaling], ids=["llama", "llama3-rope-gqa"])
@torch.no_grad()
def test_llama_decoder_gives_the_models_logits_at_every_step(build, matmuls):
    model = build().eval()
    ids, mask = prompts()
    ours, theirs, first_ours, first_theirs = decoders(model, ids, mask, steps=12)
    torch.testing.assert_close(first_ours, first_theirs, rtol=1e-5, atol=1e-5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(11):
        token = torch.randint(3, 259, (4,), generator=generator)
        torch.testing.assert_close(ours(token), theirs(token), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kind, build",
    [
        (LlamaDecoder, llama_with_rope_scaling),
        (TransformersDecoder, llama_with_rope_scaling),
        (TransformersDecoder, tiny_gpt2),
    ],
    ids=["llama", "transformers-llama", "transformers-gpt2"],
)
@torch.no_grad()
def test_rows_kept_decode_as_they_would_have_in_the_whole_batch(kind, build, matmuls):
    """After `keep([3, 1])` the decoder's rows are the batch's rows 3 and 1, their caches and
    positions intact (rows 3 and 1 have different prompt lengths), the others gone."""
    model = build().eval()
    ids, mask = prompts()
    whole, kept = [kind(model, 8) if kind is LlamaDecoder else kind(model) for _ in range(2)]
    torch.testing.assert_close(whole.prefill(ids, mask), kept.prefill(ids, mask), rtol=0, atol=0)
    generator = torch.Generator().manual_seed(0)
    for step in range(7):
        token = torch.randint(3, 259, (4,), generator=generator)
        expected = whole(token)
        if step == 2:
            kept.keep(torch.tensor([3, 1]))
        got = kept(token if step < 2 else token[[3, 1]])
        torch.testing.assert_close(got, expected if step < 2 else expected[[3, 1]], rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_kind
@torch.no_grad()
def test_llama_decoder_in_bf16_rounds_where_transformers_does(matmuls):
    """bf16: every step's largest logit gap to transformers' forward stays within a few bf16 ulps.

    The two differ in where the attention rounds (float32 matmuls here, SDPA's bf16 kernel there).
    On a CPU without bf16 reorders the "machine" run takes the plain path as well: it must not crash.
    """
    model = llama_with_rope_scaling().to(torch.bfloat16).eval()
    ids, mask = prompts()
    ours, theirs, first_ours, first_theirs = decoders(model, ids, mask, steps=24)
    generator = torch.Generator().manual_seed(0)
    for step in range(24):
        token = torch.randint(3, 259, (4,), generator=generator)
        expected = first_theirs if step == 0 else theirs(token)
        ulp = 2.0 ** (torch.floor(torch.log2(expected.abs().max())) - 7)  # bf16 spacing at the largest logit
        gap = ((first_ours if step == 0 else ours(token)) - expected).abs().max()
        assert gap <= 8 * ulp  # measured: the prefill and 1.4 to 4 ulps over these 23 steps


def test_decoder_for_uses_the_llama_step_only_where_it_reproduces_the_model():
    lora = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))  # adapters not merged
    biased = tiny_llama()
    biased.config.attention_bias = True
    for model, expected in [
        (tiny_llama(), LlamaDecoder),
        (tiny_gpt2(), TransformersDecoder),
        (lora, TransformersDecoder),
    ]:
        assert isinstance(decoder_for(model, 3), expected)
    dynamic_rope = tiny_llama()
    dynamic_rope.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert is_plain_llama(tiny_llama()) and not is_plain_llama(biased) and not is_plain_llama(dynamic_rope)


def test_generation_backend_overrides_the_choice_or_names_the_setting():
    assert isinstance(decoder_for(tiny_llama(), 3, "transformers"), TransformersDecoder)
    assert isinstance(decoder_for(tiny_llama(), 3, "llama"), LlamaDecoder)
    with pytest.raises(ValueError, match="generation_backend='llama' needs a plain LlamaForCausalLM"):
        decoder_for(tiny_gpt2(), 3, "llama")
    with pytest.raises(ValueError, match="generation_backend='vllm' is not one of"):
        decoder_for(tiny_llama(), 3, "vllm")


@torch.no_grad()
def test_both_backends_decode_the_same_greedy_tokens():
    from transformers import GenerationConfig

    from grpo_hf.engine.local import generate

    model, (ids, mask) = tiny_llama().eval(), prompts()
    config = GenerationConfig(do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=[2])
    ours = generate(model, ids, mask, config, "llama").completion_ids
    assert torch.equal(ours, generate(model, ids, mask, config, "transformers").completion_ids)


@torch.no_grad()
def test_weights_changed_between_rounds_are_reordered_again_and_the_rest_reused():
    model = tiny_llama().eval().requires_grad_(False)  # as the generation copy
    ids, mask = prompts()
    first_round = LlamaDecoder(model, 2)
    first_round.prefill(ids, mask)
    model.model.layers[0].self_attn.q_proj.weight.add_(0.5)  # in place, as GenerationCopy.refresh writes
    second_round = LlamaDecoder(model, 2)
    torch.testing.assert_close(second_round.prefill(ids, mask), TransformersDecoder(model).prefill(ids, mask))
    assert second_round.layers[0][1] is not first_round.layers[0][1]  # q/k/v: reordered again
    assert second_round.layers[0][4] is first_round.layers[0][4]  # gate/up: reused
    down = model.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(torch.randn_like(down.weight))  # a new tensor in its place
    torch.testing.assert_close(
        LlamaDecoder(model, 2).prefill(ids, mask), TransformersDecoder(model).prefill(ids, mask)
    )


def test_weights_that_require_grad_are_reordered_every_round():
    """Fused AdamW writes parameters without bumping their version counters."""
    model = tiny_llama().eval()
    ids, mask = prompts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    with torch.no_grad():
        LlamaDecoder(model, 2).prefill(ids, mask)
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    versions = [p._version for p in model.parameters()]
    optimizer.step()
    assert [p._version for p in model.parameters()] == versions  # the writes left no trace
    with torch.no_grad():
        torch.testing.assert_close(
            LlamaDecoder(model, 2).prefill(ids, mask), TransformersDecoder(model).prefill(ids, mask)
        )
