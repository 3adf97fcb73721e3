"""Mixture-of-Experts load balancing (`router_aux_loss_coef`) on tiny Qwen3-MoE and Mixtral models."""

import math

import pytest
import torch
from tiny_models import LLAMA_LIKE, tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, length_reward, make_config
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from grpo_hf.engine.logprobs import completion_logps, position_ids_from_mask
from grpo_hf.training.moe import RouterAuxLoss, resolve_router_aux_loss_coef


def tiny_qwen3_moe(num_experts: int = 4, top_k: int = 2) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=259, moe_intermediate_size=16, num_experts=num_experts, num_experts_per_tok=top_k,
        eos_token_id=2, **LLAMA_LIKE,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config)


def tiny_mixtral() -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=259, num_local_experts=4, num_experts_per_tok=2, eos_token_id=2, **LLAMA_LIKE
        )
    )


def test_the_coefficient_defaults_to_the_model_configs():
    moe = tiny_qwen3_moe()  # its config says 0.001
    assert resolve_router_aux_loss_coef(moe, None) == 0.001
    assert resolve_router_aux_loss_coef(moe, 0.0) == 0.0
    assert resolve_router_aux_loss_coef(moe, 0.5) == 0.5
    assert resolve_router_aux_loss_coef(tiny_llama(), None) == 0.0  # no router: nothing to add
    with pytest.raises(
        ValueError, match="router_aux_loss_coef=0.5 but LlamaForCausalLM is not a Mixture-of-Experts"
    ):
        resolve_router_aux_loss_coef(tiny_llama(), 0.5)


def test_load_balancing_counts_a_shared_prompt_once_per_row():
    """Two experts, top-1, both layers routing alike. Prompt token p is shared by both rows (weight
    2), completions: row 0 [a, padding], row 1 [b, d]. softmax([ln 3, 0]) = [0.75, 0.25].
    p [ln3, 0] -> expert 0, a [0, ln3] -> 1, b [ln3, 0] -> 0, d [0, ln3] -> 1; weights 2, 1, 1, 1 (sum 5).
    Share of tokens f = (3/5, 2/5); mean probability P0 = (2 x 0.75 + 0.25 + 0.75 + 0.25) / 5 = 0.55,
    P1 = 0.45. Loss = E x sum f P = 2 x (0.6 x 0.55 + 0.4 x 0.45) = 1.02 (1.0 were p counted once)."""
    aux = RouterAuxLoss(tiny_qwen3_moe(num_experts=2, top_k=1), coef=1.0)
    high, low = math.log(3.0), 0.0
    input_ids = torch.tensor([[7, 10, 0], [7, 11, 12]])  # prompt width 1, completion width 2
    attention_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    prefill = torch.tensor([[high, low]])  # (U * P, E): the distinct prompt
    completions = torch.tensor([[low, high], [high, low], [high, low], [low, high]])  # a, pad, b, d
    calls = [
        {"mask": torch.tensor([[1]]), "width": 1, "logits": [prefill, prefill]},
        {"mask": attention_mask, "width": 2, "logits": [completions, completions]},
    ]
    assert aux.loss(calls, input_ids, attention_mask, completion_width=2).item() == pytest.approx(1.02)


def rows_with_shared_prompts():
    """2 prompts x 2 rows, left-padded prompts, right-padded completions of 1 to 3 tokens."""
    prompt = torch.tensor([[0, 0, 5, 6], [0, 0, 5, 6], [7, 8, 9, 10], [7, 8, 9, 10]])
    prompt_mask = (prompt != 0).long()
    completion = torch.tensor([[11, 12, 13], [14, 0, 0], [15, 16, 0], [17, 18, 19]])
    completion_mask = (completion != 0).long()
    return torch.cat([prompt, completion], 1), torch.cat([prompt_mask, completion_mask], 1)


@pytest.mark.parametrize("build", [tiny_qwen3_moe, tiny_mixtral], ids=["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["shared-prompts", "whole-rows"])
def test_the_loss_pass_gives_the_whole_row_aux_loss(build, checkpointing):
    """Recorded during our loss pass (each distinct prompt once, or whole rows under gradient
    checkpointing), the aux loss is the model's own on whole rows (what TRL adds)."""
    model = build()
    input_ids, attention_mask = rows_with_shared_prompts()
    aux = RouterAuxLoss(model, coef=None)
    with aux.recording() as calls:
        completion_logps(model, input_ids, attention_mask, 3, gradient_checkpointing=checkpointing)
    assert len(calls) == (1 if checkpointing else 2)
    ours = aux.loss(calls, input_ids, attention_mask, completion_width=3)
    whole = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        output_router_logits=True,
    ).aux_loss
    torch.testing.assert_close(ours, whole, rtol=1e-5, atol=1e-6)


def moe_trainer(tmp_path, **overrides) -> FixedCompletionsTrainer:
    return FixedCompletionsTrainer(
        model=tiny_qwen3_moe(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, **overrides),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )


def test_the_aux_loss_is_added_with_its_coefficient_and_trains_the_routers(tmp_path):
    trainer = moe_trainer(tmp_path, router_aux_loss_coef=0.5, max_steps=2)
    trainer.model.train()
    batch = trainer._prepare_inputs([dict(row) for row in chat_dataset().select([0] * 4 + [1] * 4)])
    with_aux = trainer.compute_loss(trainer.model, batch)
    aux = trainer.metrics.values["train"]["aux_loss"][-1]
    trainer.router_aux.coef = 0.0
    without = trainer.compute_loss(trainer.model, batch)
    assert with_aux.item() - without.item() == pytest.approx(0.5 * aux, rel=1e-4)
    assert aux > 1.0  # E x sum f P >= 1, with equality only for perfectly balanced routing

    trainer = moe_trainer(tmp_path, router_aux_loss_coef=0.5, max_steps=2)
    routers = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "mlp.gate" in n}
    assert routers
    trainer.train()
    assert all("aux_loss" in entry for entry in trainer.state.log_history if "loss" in entry)
    moved = {n: not torch.equal(p, routers[n]) for n, p in trainer.model.named_parameters() if n in routers}
    assert all(moved.values()), moved


def test_no_aux_loss_when_its_coefficient_is_zero(tmp_path):
    trainer = moe_trainer(tmp_path, router_aux_loss_coef=0.0, max_steps=1)
    trainer.train()
    assert not any("aux_loss" in entry for entry in trainer.state.log_history)


def test_a_coefficient_for_a_model_without_routers_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        FixedCompletionsTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(tmp_path, router_aux_loss_coef=0.01),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
        )
