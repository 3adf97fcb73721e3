"""cast_lm_head_to_fp32: the LM head computes in float32 in every pass that scores or samples tokens."""

import pytest
import torch
from peft import LoraConfig
from tiny_models import LLAMA_LIKE, tiny_gpt2, tiny_llama, tiny_mistral, tiny_tokenizer
from trainer_helpers import chat_dataset, length_reward, make_config
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from grpo_hf import GRPOTrainer
from grpo_hf.engine import cpu, local, logprobs
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.logprobs import completion_logps
from grpo_hf.models.policy import Float32Head, cast_lm_head_to_fp32

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26]])  # (2, 7): completion C = 3
C = 3


def float64_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(hidden @ weight.T) at the targets, in float64: the reference for a float32 head."""
    logits = hidden.double() @ weight.double().T  # (..., V)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_the_head_computes_in_float32_under_bf16_autocast():
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 259, bias=False)
    hidden = torch.randn(6, 32).bfloat16()  # (6, 32)
    want = hidden.double() @ head.weight.double().T  # (6, V)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = head(hidden)
        head.__class__ = Float32Head
        cast = head(hidden)
    assert plain.dtype == torch.bfloat16 and cast.dtype == torch.float32
    torch.testing.assert_close(cast.double(), want, rtol=1e-6, atol=1e-6)
    assert (plain.double() - want).abs().max() > 1e-3  # a bf16 product is visibly rounded


def test_cast_keeps_the_parameters_and_their_names():
    model = tiny_llama().to(torch.bfloat16)
    weight = model.lm_head.weight
    before = weight.detach().clone()
    keys = list(model.state_dict())
    cast_lm_head_to_fp32(model)
    assert type(model.lm_head) is Float32Head and model.lm_head.weight is weight  # the same Parameter
    assert weight.dtype == torch.float32 and torch.equal(weight.detach(), before.float())
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # the rest untouched
    assert list(model.state_dict()) == keys


def test_fused_head_of_the_padding_free_pass_computes_in_float32(monkeypatch):
    """A bf16 Llama: with the cast, the fused LM head takes its products in float32 from the float32
    weight (the dtype it is handed, and values equal to a float64 reference on the same hidden
    states); without, in bf16. Training the head, its gradient is float32 too."""
    calls = []
    original = logprobs.head_token_logps

    def spy(hidden, weight, targets, temperature, with_entropy, dtype, entropy_grad=False, truncation=None):
        calls.append((hidden.detach(), weight.detach(), targets, dtype))
        return original(hidden, weight, targets, temperature, with_entropy, dtype, entropy_grad, truncation)

    monkeypatch.setattr(logprobs, "head_token_logps", spy)
    model = tiny_llama().to(torch.bfloat16)
    with torch.no_grad():
        completion_logps(model, IDS, torch.ones_like(IDS), C)
    assert calls.pop()[3] == torch.bfloat16
    cast_lm_head_to_fp32(model)
    logps, _, _ = completion_logps(model, IDS, torch.ones_like(IDS), C)  # (2, C)
    hidden, weight, targets, dtype = calls.pop()
    assert dtype == torch.float32 and weight.dtype == torch.float32
    # the packed row's first B positions are each row's first completion token, then the others
    want = float64_logps(hidden, weight, targets)  # (B + K,)
    got = torch.cat([logps[:, 0], logps[:, 1:].flatten()])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    logps.sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.float32


def head_dtypes(monkeypatch) -> list:
    """The dtype every fused LM-head call computes in, recorded as the calls happen."""
    dtypes = []
    original = logprobs.head_token_logps
    monkeypatch.setattr(
        logprobs,
        "head_token_logps",
        lambda *args, **kwargs: dtypes.append(args[5]) or original(*args, **kwargs),
    )
    return dtypes


def bf16_head_trainer(tmp_path, model) -> GRPOTrainer:
    """One --bf16 step of `model` with cast_lm_head_to_fp32 and a reference model (beta 0.04)."""
    return GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_config(tmp_path, cast_lm_head_to_fp32=True, bf16=True, beta=0.04, max_steps=1),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )


def test_fused_head_is_float32_under_the_trainers_bf16_autocast(monkeypatch):
    dtypes = head_dtypes(monkeypatch)
    model = tiny_llama()  # float32 weights, bf16 autocast: mixed precision as --bf16 runs it
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        completion_logps(model, IDS, torch.ones_like(IDS), C)
        cast_lm_head_to_fp32(model)
        completion_logps(model, IDS, torch.ones_like(IDS), C)
    assert dtypes == [torch.bfloat16, torch.float32]


def test_unfused_pass_of_other_models_goes_through_the_float32_head():
    """A Mistral (not packable) runs its own forward: the head's output is float32 and exact to a
    float64 reference on the bf16 hidden states it got."""
    model = tiny_mistral().to(torch.bfloat16)
    cast_lm_head_to_fp32(model)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        logps, _, _ = completion_logps(model, IDS, torch.ones_like(IDS), C)
    assert logps.dtype == torch.float32
    for hidden, out in seen:
        assert hidden.dtype == torch.bfloat16 and out.dtype == torch.float32
        want = hidden.double() @ model.lm_head.weight.double().T
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def tied_llama() -> LlamaForCausalLM:
    """tiny_llama with its LM head tied to its input embedding (SmolLM2's, Gemma's layout)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=259, eos_token_id=2, bos_token_id=1, tie_word_embeddings=True, **LLAMA_LIKE
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("build", [tied_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_a_tied_head_computes_in_float32_and_keeps_the_shared_weight(build):
    """bf16 weights: the head becomes a Float32Head, still the embedding's very Parameter in bf16 (TRL
    casts it, and the embedding with it); its output is float32, equal to a float64 product on the
    exact upcast, while the embedding still hands bf16 to the layers."""
    model = build().to(torch.bfloat16)
    shared = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is shared
    cast_lm_head_to_fp32(model)
    head = model.get_output_embeddings()
    assert type(head) is Float32Head and head.weight is shared and shared.dtype == torch.bfloat16
    assert model.get_input_embeddings()(torch.tensor([[5, 6]])).dtype == torch.bfloat16
    hidden = torch.randn(3, 32).bfloat16()  # (3, E)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(hidden)  # (3, V)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), hidden.double() @ shared.double().T, rtol=1e-6, atol=1e-6)


def test_the_decoding_loop_multiplies_a_tied_head_in_float32(monkeypatch):
    """The bf16 generation copy of a cast, tied Llama keeps the shared weight in bf16 (the embedding's
    dtype); LlamaDecoder still takes the LM head's product on a float32 weight, as for an untied head."""
    dtypes = {}
    original = cpu.BlockedLinear.__init__

    def spy(self, weight, rows):
        dtypes[tuple(weight.shape)] = weight.dtype
        original(self, weight, rows)

    monkeypatch.setattr(cpu.BlockedLinear, "__init__", spy)
    policy = tied_llama()
    cast_lm_head_to_fp32(policy)
    copy = GenerationCopy(policy, torch.bfloat16).model
    assert (
        copy.lm_head.weight is copy.model.embed_tokens.weight and copy.lm_head.weight.dtype == torch.bfloat16
    )
    config = GenerationConfig(do_sample=False, max_new_tokens=3, pad_token_id=0, eos_token_id=[2])
    local.generate(copy, IDS, torch.ones_like(IDS), config, backend="llama")
    assert dtypes[(259, 32)] == torch.float32  # the head (V, E)
    assert dtypes[(32, 32)] == torch.bfloat16  # o_proj: the rest of the copy stays bf16


def test_an_adapted_head_is_refused_with_the_setting_named(tmp_path):
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32.*lm_head"):
        GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(tmp_path, cast_lm_head_to_fp32=True),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
        )


def test_training_with_a_float32_head_under_bf16(tmp_path, monkeypatch):
    """--bf16 on a float32 Llama: the policy's, the reference's and the bf16 generation copy's heads are
    float32 (the copy's other weights bf16, decoded by LlamaDecoder); every scoring pass computes the
    head in float32; the head trains."""
    dtypes = head_dtypes(monkeypatch)
    trainer = bf16_head_trainer(tmp_path, tiny_llama())
    copy = trainer.generator.copy.model  # the bf16 generation copy the local generator samples from
    assert (
        copy.model.embed_tokens.weight.dtype == torch.bfloat16 and copy.lm_head.weight.dtype == torch.float32
    )
    for model in (trainer.model, trainer.ref_model, copy):
        assert type(model.lm_head) is Float32Head and model.lm_head.weight.dtype == torch.float32
    before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    assert dtypes and set(dtypes) == {torch.float32}  # reference and policy passes
    assert not torch.equal(trainer.model.lm_head.weight, before)
    assert trainer.state.log_history[0]["completions/mean_length"] > 0


def test_training_a_tied_head_under_bf16(tmp_path, monkeypatch):
    """--bf16 on a float32 tied Llama (TRL casts it too): every scoring pass computes the head in
    float32; the head, which is the embedding, trains and stays tied to it."""
    dtypes = head_dtypes(monkeypatch)
    trainer = bf16_head_trainer(tmp_path, tied_llama())
    for model in (trainer.model, trainer.ref_model, trainer.generator.copy.model):
        assert type(model.lm_head) is Float32Head and model.lm_head.weight is model.model.embed_tokens.weight
    before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    assert dtypes and set(dtypes) == {torch.float32}  # reference and policy passes
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
    assert not torch.equal(trainer.model.lm_head.weight, before)
