"""The generation copy: the policy's weights (LoRA merged) in another dtype, refreshed each round."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import FAMILIES, tiny_family, tiny_gpt2, tiny_llama, tiny_tokenizer
from trainer_helpers import BEST_MODEL_SETTINGS, BestAtStep, chat_dataset, length_reward, make_config
from transformers import GenerationConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from grpo_hf import GRPOTrainer
from grpo_hf.data import rollout
from grpo_hf.engine import local
from grpo_hf.engine.generation_copy import DECODE_ATTENTION, GenerationCopy, decode_attention, policy_weights


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_lora_copy_equals_the_policy_after_the_adapters_move():
    for build, targets in ((tiny_llama, ["q_proj", "v_proj"]), (tiny_gpt2, ["c_attn"])):
        policy = get_peft_model(build().eval(), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        copy = GenerationCopy(policy, torch.float32)
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)  # adapters trained after the copy was made
        ids = torch.randint(3, 250, (2, 10))
        stale = logits(copy.model, ids)
        fresh = logits(copy.refresh(), ids)
        expected = logits(policy, ids)
        torch.testing.assert_close(fresh, expected, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(stale, expected, atol=1e-3)  # refresh is what brought it up to date
        assert not any("lora" in n for n, _ in copy.model.named_parameters())  # plain model, no adapters


def test_lora_copy_follows_modules_to_save_and_trained_biases():
    """lm_head and the embeddings train whole (modules_to_save), the attention biases train with
    bias="all": the refreshed copy must hold their current values, not those at copy time."""
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head", "embed_tokens"]
    )
    policy = get_peft_model(tiny_llama().eval(), config)
    copy = GenerationCopy(policy, torch.float32)
    with torch.no_grad():
        for param in policy.parameters():
            if param.requires_grad:
                param.add_(0.5)  # every trainable parameter moved after the copy was made
    ids = torch.randint(3, 250, (2, 10))
    torch.testing.assert_close(logits(copy.refresh(), ids), logits(policy, ids), rtol=1e-4, atol=1e-4)
    trained = policy.get_base_model()
    torch.testing.assert_close(copy.model.lm_head.weight, trained.lm_head.modules_to_save["default"].weight)
    embed = trained.model.embed_tokens.modules_to_save["default"].weight
    torch.testing.assert_close(copy.model.model.embed_tokens.weight, embed)


def test_gpt2_lora_copy_follows_trained_biases():
    policy = get_peft_model(
        tiny_gpt2().eval(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], bias="all")
    )
    copy = GenerationCopy(policy, torch.float32)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if param.requires_grad and "bias" in name:
                param.add_(0.5)
    ids = torch.randint(3, 250, (2, 10))
    torch.testing.assert_close(logits(copy.refresh(), ids), logits(policy, ids), rtol=1e-4, atol=1e-4)


def test_full_model_copy_in_bf16_tracks_the_policy():
    policy = tiny_llama().eval()
    copy = GenerationCopy(policy, torch.bfloat16)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.01)
    ids = torch.randint(3, 250, (2, 10))
    refreshed = copy.refresh()
    assert all(p.dtype == torch.bfloat16 for p in refreshed.parameters())
    torch.testing.assert_close(logits(refreshed, ids), logits(policy, ids), rtol=0.05, atol=0.05)


def test_bf16_training_generates_from_the_copy_and_keeps_the_base_frozen(tmp_path):
    model = tiny_llama()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_config(tmp_path, bf16=True),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.generator.copy is not None
    trainer.train()
    for name, param in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(param.cpu(), base[name.replace(".base_layer", "")]), name


def test_evaluate_after_train_samples_from_the_best_model_loaded_at_the_end(tmp_path):
    """load_best_model_at_end loads checkpoint-2 after step 3, with no new optimizer step: the
    evaluate() that follows samples from a copy refreshed to it (LoRA merged), not step 3's copy."""
    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, max_steps=3, **BEST_MODEL_SETTINGS),
        train_dataset=chat_dataset(),
        eval_dataset=chat_dataset(2),
        processing_class=tiny_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        callbacks=[BestAtStep(2)],
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2") and trainer.state.global_step == 3
    trainer.evaluate()
    copy = dict(trainer.generator.copy.model.named_parameters())
    best = dict(policy_weights(trainer.model))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(best[q], trainer.model.get_base_model().model.layers[0].self_attn.q_proj.weight)
    for name, weight in best.items():
        torch.testing.assert_close(copy[name], weight, rtol=0, atol=1e-6, msg=name)


def test_decode_attention_equals_sdpa_for_one_query_token():
    """Grouped queries (9 heads over 3 key/value heads), a padded row, float32 inputs: same as SDPA."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    query = torch.randn(4, 9, 1, 16)  # (B, H, 1, D)
    key, value = torch.randn(4, 3, 11, 16), torch.randn(4, 3, 11, 16)  # (B, KV, L, D)
    mask = torch.ones(4, 1, 1, 11, dtype=torch.bool)
    mask[1, ..., :5] = False  # a left-padded row
    ours, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (4, 1, 9, 16)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_generation_copy_decodes_the_same_tokens_as_the_policy(build):
    """The copy's attention backend changes nothing: same greedy tokens from an fp32 copy."""
    tokenizer, policy = tiny_tokenizer(), build().eval()
    copy = GenerationCopy(policy, torch.float32).refresh()
    assert copy.config._attn_implementation == DECODE_ATTENTION
    texts = [
        rollout.render_prompt(tokenizer, [{"role": "user", "content": t}])
        for t in ("Hi", "A longer question?")
    ]
    ids, mask = rollout.tokenize_prompts(tokenizer, texts, None, torch.device("cpu"))
    config = GenerationConfig(do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=[2])
    ours = local.generate(copy, ids, mask, config).completion_ids
    theirs = local.generate(policy, ids, mask, config).completion_ids
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_samples_from_its_copy_and_trains_with_a_float32_head(tmp_path, family):
    """A float32 copy of each family the README names greedily draws the policy's tokens with its
    log-probs, in the attention transformers gives the family: ours for one query token where SDPA
    computes the model's, else the model's own (Gemma 2's soft-capping, which SDPA refuses). Then
    TRL's case: one step of bf16 generation with cast_lm_head_to_fp32."""
    tokenizer, policy = tiny_tokenizer(), tiny_family(family).eval()
    copy = GenerationCopy(policy, torch.float32).refresh()
    texts = [
        rollout.render_prompt(tokenizer, [{"role": "user", "content": t}])
        for t in ("Hi", "A longer question?")
    ]
    ids, mask = rollout.tokenize_prompts(tokenizer, texts, None, torch.device("cpu"))
    config = GenerationConfig(do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=[2])
    ours, theirs = local.generate(copy, ids, mask, config), local.generate(policy, ids, mask, config)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    torch.testing.assert_close(ours.sampler_logps, theirs.sampler_logps, rtol=1e-5, atol=1e-5)
    own = policy.config._attn_implementation
    assert copy.config._attn_implementation == (DECODE_ATTENTION if policy._supports_sdpa else own)
    trainer = GRPOTrainer(
        model=tiny_family(family),
        reward_funcs=length_reward,
        args=make_config(tmp_path, max_steps=1, generation_dtype="bfloat16", cast_lm_head_to_fp32=True),
        train_dataset=chat_dataset(),
        processing_class=tokenizer,
    )
    trainer.train()
    assert trainer.state.global_step == 1


@torch.no_grad()
def test_float32_lora_training_samples_from_a_merged_float32_copy(tmp_path):
    """With LoRA a copy is made in the model's own dtype too, so a Llama decodes on plain weights."""
    policy = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            param.normal_(0, 0.5)  # adapters that change the model
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=length_reward,
        args=make_config(tmp_path),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    copy = trainer.generator.copy
    assert copy is not None and next(copy.model.parameters()).dtype == torch.float32
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], device=policy.device)  # where the trainer put it
    mask = torch.ones_like(ids)
    config = GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=[2])
    merged = local.generate(copy.refresh(), ids, mask, config).completion_ids
    assert torch.equal(merged, local.generate(policy, ids, mask, config).completion_ids)
