"""What the loss passes keep for backward grows linearly with the completion length.

Bytes saved for backward (unique storages, parameters left out) by a policy pass of a tiny model
at W and 2W completion tokens. Attention that kept its probabilities, rows x heads x W^2 in every
layer, would more than triple them here (the last test shows it does); linear buffers double.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import LLAMA_LIKE, tiny_gpt2
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_hf.engine import packing
from grpo_hf.engine.logprobs import completion_logps

WIDTH = 512  # completion tokens; x 4 heads x 4 bytes of probabilities per token and layer


def long_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, eos_token_id=2, bos_token_id=1, **LLAMA_LIKE)
    config.max_position_embeddings = 4 * WIDTH
    return LlamaForCausalLM(config)


def long_gpt2() -> torch.nn.Module:
    model = tiny_gpt2()
    config = model.config
    config.n_positions = 4 * WIDTH
    torch.manual_seed(0)
    return type(model)(config)


def saved_bytes(model: torch.nn.Module, width: int, **kwargs) -> int:
    """Bytes of the distinct storages a policy pass (2 prompts x 2 completions of `width`) saves for backward."""
    torch.manual_seed(0)
    prompts = torch.randint(3, 250, (2, 8)).repeat_interleave(2, dim=0)  # (4, 8)
    ids = torch.cat([prompts, torch.randint(3, 250, (4, width))], dim=1)  # (4, 8 + W)
    mask = torch.ones_like(ids)
    mask[1, -width // 4 :] = 0  # one completion ends early
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps, _, _ = completion_logps(
            model, ids, mask, width, with_entropy=True, entropy_grad=False, **kwargs
        )
    logps.sum().backward()  # the pass really is differentiable
    return sum(storages.values())


def lora(model: torch.nn.Module) -> torch.nn.Module:
    targets = ["q_proj", "v_proj"] if isinstance(model, LlamaForCausalLM) else ["c_attn"]
    return get_peft_model(model, LoraConfig(r=4, target_modules=targets))


@pytest.mark.parametrize(
    "build",
    [long_llama, lambda: lora(long_llama()), lambda: lora(long_gpt2()), long_gpt2],
    ids=["llama-full", "llama-lora", "gpt2-lora", "gpt2-full"],
)
def test_saved_for_backward_grows_linearly_with_completion_length(build):
    model = build().eval()
    short, long = saved_bytes(model, WIDTH), saved_bytes(model, 2 * WIDTH)
    assert long <= 2.2 * short, (short, long)


def test_gradient_checkpointing_saves_less_and_still_linearly():
    model = long_llama().train()
    plain = saved_bytes(model, WIDTH)
    model.gradient_checkpointing_enable()
    short, long = saved_bytes(model, WIDTH), saved_bytes(model, 2 * WIDTH)
    assert short < plain / 2, (plain, short)
    assert long <= 2.2 * short, (short, long)


def test_attention_that_keeps_its_probabilities_fails_the_bound(monkeypatch):
    """The check bites: `grouped_attention` at every length keeps rows x heads x W^2 per layer."""
    monkeypatch.setattr(packing, "GROUPED_MAX_SCORES", 10**12)
    model = long_llama().eval()
    short, long = saved_bytes(model, WIDTH), saved_bytes(model, 2 * WIDTH)
    assert long > 3 * short, (short, long)
