"""Completion log-probs through tiny models: against a full forward, shared prompts, padding, kernels."""

import pytest
import torch
import transformers
from packaging.version import Version
from peft import LoraConfig, get_peft_model
from test_token_scores import direct
from tiny_models import tiny_gpt2, tiny_llama, tiny_mistral
from transformers import LlamaForCausalLM

from grpo_hf.engine import logprobs
from grpo_hf.engine.logprobs import cache_keyword, completion_logps, position_ids_from_mask


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # (2, 5)
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_which_heads_fuse():
    model = tiny_llama()
    assert logprobs.scoring_head(model) is model.lm_head  # trained (full fine-tuning): recomputed in backward
    model.requires_grad_(False)
    assert logprobs.scoring_head(model) is model.lm_head  # frozen (LoRA)
    wrapper = torch.nn.Module()
    wrapper.module = model  # as DDP and DeepSpeed hold the model
    assert logprobs.scoring_head(wrapper) is model.lm_head
    model.lm_head = torch.nn.Linear(*model.lm_head.weight.shape[::-1], bias=True)
    assert logprobs.scoring_head(model) is None  # a bias: the model's own head and `token_logps_and_entropy`


# ---- Through a tiny Llama ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama().eval()


PROMPT_AND_COMPLETION = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])  # (1, 7): prompt 4, completion C = 3
C = 3


def test_completion_logps_match_a_full_forward(model):
    temperature = 0.7
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26]])  # (2, 7)
    mask = torch.ones_like(ids)  # (2, 7)
    logps, entropy, _ = completion_logps(model, ids, mask, C, temperature, with_entropy=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # (2, 7, V)
    # Position t predicts token t + 1: positions 3..5 predict the completion tokens 4..6.
    want_logps, want_entropy = direct(logits[:, -C - 1 : -1], ids[:, -C:], temperature)  # (2, C)
    assert logps.shape == (2, C)
    torch.testing.assert_close(logps, want_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)


def test_left_padded_row_equals_the_unpadded_row(model):
    pad = 0
    alone, _, _ = completion_logps(
        model, PROMPT_AND_COMPLETION, torch.ones(1, 7, dtype=torch.long), C
    )  # (1, C)
    padded_ids = torch.tensor(
        [[pad, pad, 5, 6, 7, 8, 9, 10, 11], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    )  # (2, 9)
    padded_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])  # (2, 9)
    batched, _, _ = completion_logps(model, padded_ids, padded_mask, C)  # (2, C)
    torch.testing.assert_close(batched[0:1], alone, rtol=0, atol=1e-5)
    # The check can fail: attending to the pads (mask of ones) moves the log-probs.
    unmasked, _, _ = completion_logps(model, padded_ids, torch.ones_like(padded_ids), C)  # (2, C)
    assert (unmasked[0:1] - alone).abs().max() > 1e-4


# ---- Shared prompts: each distinct prompt runs once ------------------------------------------


def grouped_batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Two prompts (one left-padded) x 3 completions each; completions end early with padding."""
    torch.manual_seed(0)
    prompts = torch.tensor([[0, 0, 5, 6, 7]] * 3 + [[8, 9, 10, 11, 12]] * 3)  # (6, 5)
    prompt_mask = (prompts != 0).long()  # (6, 5)
    completions = torch.randint(3, 250, (6, 4))  # (6, 4)
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]] * 2)  # after EOS: 0
    completions = completions.masked_fill(completion_mask == 0, 0)
    ids = torch.cat([prompts, completions], dim=1)  # (6, 9)
    return ids, torch.cat([prompt_mask, completion_mask], dim=1), 4


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_shared_prompts_give_the_same_logps_and_gradients(build):
    ids, mask, width = grouped_batch()
    completion_mask = mask[:, -width:].float()  # (6, 4)
    results = []
    for share in (False, True):
        model = build().eval()  # GPT-2's dropout would make the two passes differ
        logps, _, _ = completion_logps(
            model, ids, mask, width, 0.9, gradient_checkpointing=not share
        )  # (6, 4)
        (logps * completion_mask).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach() * completion_mask, grads))
    (whole, whole_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, whole, rtol=1e-5, atol=1e-5)
    assert whole_grads.keys() == shared_grads.keys() and len(whole_grads) > 10
    for name in whole_grads:
        torch.testing.assert_close(shared_grads[name], whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_prefill_runs_each_distinct_prompt_once(model):
    ids, mask, width = grouped_batch()
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    try:
        completion_logps(model, ids, mask, width)
    finally:
        hook.remove()
    # One row: the two distinct prompts' 3 + 5 real tokens, then the 4 + 2 + 1 real completion tokens of each.
    assert seen == [torch.Size([1, 22])]


def test_completion_of_one_token(model):
    ids, mask, _ = grouped_batch()
    shared, _, _ = completion_logps(model, ids[:, :6], mask[:, :6], 1)  # (6, 1)
    whole, _, _ = completion_logps(model, ids[:, :6], mask[:, :6], 1, gradient_checkpointing=True)
    torch.testing.assert_close(shared, whole, rtol=1e-5, atol=1e-5)


def test_math_attention_only_for_short_batches_on_a_cpu(monkeypatch):
    chosen = []
    real = logprobs.sdpa_kernel
    monkeypatch.setattr(logprobs, "sdpa_kernel", lambda backend: chosen.append(backend) or real(backend))
    with logprobs.attention_kernel(torch.zeros(16, 256, dtype=torch.long)):  # 16 x 256^2: the limit
        pass
    with logprobs.attention_kernel(torch.zeros(16, 257, dtype=torch.long)):  # one token more: SDPA decides
        pass
    assert chosen == [logprobs.SDPBackend.MATH]


def test_either_attention_kernel_gives_the_same_logps(monkeypatch):
    """The padded pass (a model that cannot pack) takes the math kernel on short batches."""
    model = tiny_mistral().eval()
    ids, mask, width = grouped_batch()
    kernels = []
    real = logprobs.sdpa_kernel
    monkeypatch.setattr(logprobs, "sdpa_kernel", lambda backend: kernels.append(backend) or real(backend))
    math_logps, _, _ = completion_logps(model, ids, mask, width)
    assert kernels == [logprobs.SDPBackend.MATH]  # a short batch on a CPU
    monkeypatch.setattr(logprobs, "MATH_ATTENTION_MAX", 0)
    default_logps, _, _ = completion_logps(model, ids, mask, width)
    assert kernels == [logprobs.SDPBackend.MATH]  # not asked again: SDPA picks
    torch.testing.assert_close(math_logps, default_logps, rtol=1e-5, atol=1e-5)


RENAMED = Version(transformers.__version__) >= Version("5.24")  # past_key_values -> cache
CURRENT = "cache" if RENAMED else "past_key_values"


class OldStyleLlama(LlamaForCausalLM):
    """A remote-code model written before transformers renamed its forward's cache argument."""

    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return super().forward(input_ids=input_ids, **{CURRENT: past_key_values}, **kwargs)


def test_the_cache_goes_by_the_name_the_models_forward_takes():
    model = tiny_llama()
    assert cache_keyword(model) == CURRENT
    assert cache_keyword(get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))) == CURRENT
    old_style = OldStyleLlama(model.config)
    old_style.load_state_dict(model.state_dict())
    assert cache_keyword(old_style) == "past_key_values"
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():  # the distinct prompts' cache handed on by the name each forward takes
        expected = logprobs.completion_logits(model, ids, mask, 2)
        assert torch.equal(logprobs.completion_logits(old_style, ids, mask, 2), expected)
