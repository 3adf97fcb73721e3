"""GRPOTrainer on tiny Llama and GPT-2 models built from configs."""

import copy

import pytest
import torch
from peft import LoraConfig
from tiny_models import tiny_gpt2, tiny_llama, tiny_tokenizer
from trainer_helpers import (
    FixedCompletionsTrainer,
    chat_dataset,
    exact_resume,
    length_reward,
    make_config,
    suite_device,
)
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer
from grpo_hf.engine.logprobs import completion_logps
from grpo_hf.models.reference import reference_context


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_full_finetuning_moves_every_parameter(tmp_path, build):
    model = build()
    before = snapshot(model)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_config(tmp_path),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    assert trainer.ref_model is not None  # beta = 0.04 > 0: a frozen copy
    for name, param in model.named_parameters():
        assert not torch.equal(before[name], param.detach().cpu()), f"{name} did not move"
    for name, param in trainer.ref_model.named_parameters():
        assert torch.equal(before[name], param.cpu()), f"reference {name} moved"
    logged = trainer.state.log_history[0]
    for key in (
        "reward",
        "reward/length_reward",
        "kl",
        "entropy",
        "clip_ratio/low",
        "completions/mean_length",
    ):
        assert key in logged


@pytest.mark.parametrize(
    ("build", "targets"), [(tiny_llama, ["q_proj", "v_proj"]), (tiny_gpt2, ["c_attn"])], ids=["llama", "gpt2"]
)
def test_lora_moves_only_adapters_and_base_is_the_reference(tmp_path, build, targets):
    model = build()
    original = copy.deepcopy(model).eval()  # the policy runs without dropout too
    before = snapshot(model)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_config(tmp_path),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=targets),
    )
    trainer.train()
    assert trainer.ref_model is None  # no second copy: the base with adapters disabled
    policy = trainer.model
    moved = {n for n, p in policy.named_parameters() if "lora_" in n and p.requires_grad}
    assert moved, "no LoRA parameters"
    for name, param in policy.named_parameters():
        base_name = name.replace("base_model.model.", "").replace(".base_layer", "")
        if "lora_" not in name:
            assert torch.equal(before[base_name], param.cpu()), f"base parameter {name} changed"
    original.to(suite_device())  # where the policy is
    ids = torch.randint(3, 250, (2, 12), device=suite_device())
    mask = torch.ones_like(ids)
    for whole_rows in (True, False):  # whole rows: the gradient checkpointing path, no shared prompts
        with reference_context(policy, None) as ref, torch.no_grad():
            ref_logps, _, _ = completion_logps(ref, ids, mask, 6, gradient_checkpointing=whole_rows)
        with torch.no_grad():
            policy_logps, _, _ = completion_logps(policy, ids, mask, 6, gradient_checkpointing=whole_rows)
            original_logps, _, _ = completion_logps(original, ids, mask, 6, gradient_checkpointing=whole_rows)
        if not whole_rows:
            # The same weights and operations; only the LM head's matmul on a strided slice may round
            # its last bit differently between two allocations (seen: 5e-7 on logps near -5.6).
            torch.testing.assert_close(ref_logps, original_logps, rtol=0, atol=2e-6)
        else:
            assert torch.equal(ref_logps, original_logps)
        assert not torch.allclose(policy_logps, original_logps)  # the adapters did learn something


def test_the_seed_decides_where_the_adapters_start(tmp_path):
    """PEFT draws each LoRA A at random: the trainer sets `seed` before making them (as TRL does), so
    two runs with one seed start from the same adapters whatever random numbers their scripts drew
    before, and another seed starts elsewhere."""

    def first_adapters(seed: int, drawn_before: int) -> dict[str, torch.Tensor]:
        model = tiny_llama()
        torch.rand(drawn_before)  # what a script may have drawn: the global random state moves on
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_config(tmp_path, seed=seed),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )
        return {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters() if "lora_A" in n}

    first, again, other = first_adapters(0, 1), first_adapters(0, 5), first_adapters(1, 1)
    assert len(first) == 4  # q and v of two layers
    for name, weight in first.items():
        assert torch.equal(weight, again[name]), name
        assert not torch.equal(weight, other[name]), name


def test_beta_zero_builds_no_reference(tmp_path):
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, beta=0.0),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    assert trainer.ref_model is None
    trainer.model.train()
    batch = trainer._prepare_inputs([dict(row) for row in chat_dataset().select([0, 0, 0, 0, 1, 1, 1, 1])])
    assert "ref_logps" not in batch
    assert "old_logps" not in batch  # one pass, one optimizer step per round


class GradCapture(TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, loss_type):
    grads = []
    for batch_size, accumulation in ((8, 1), (4, 2)):
        model = tiny_llama()
        args = make_config(
            tmp_path / f"{batch_size}",
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            loss_type=loss_type,
            max_grad_norm=0.0,
        )
        trainer = FixedCompletionsTrainer(
            model=model,
            reward_funcs=length_reward,
            args=args,
            train_dataset=chat_dataset(2),
            processing_class=tiny_tokenizer(),
        )
        capture = GradCapture(model)
        trainer.add_callback(capture)
        trainer.train()
        grads.append(capture.grads)
    big, accumulated = grads
    assert big.keys() == accumulated.keys()
    for name in big:
        torch.testing.assert_close(accumulated[name], big[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_suite_trains_on_the_device_grpo_hf_test_device_names(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_HF_TEST_DEVICE", raising=False)
    assert suite_device() == "cpu" and make_config(tmp_path).use_cpu
    assert exact_resume() == {"full_determinism": False}
    monkeypatch.setenv("GRPO_HF_TEST_DEVICE", "tpu")
    with pytest.raises(ValueError, match="GRPO_HF_TEST_DEVICE='tpu': use 'cpu'"):
        make_config(tmp_path)
    monkeypatch.setenv("GRPO_HF_TEST_DEVICE", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            suite_device()
        return
    assert not make_config(tmp_path).use_cpu and exact_resume() == {"full_determinism": True}


class StopAfter(TrainerCallback):
    """Simulates an interruption: training stops (after saving) at the given step."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize(
    ("stop_after", "round_settings"),
    [(2, {"num_iterations": 2}), (1, {"num_iterations": 2}), (1, {"steps_per_generation": 2})],
    ids=["between-rounds", "mid-round-mu2", "mid-round-two-steps"],
)
def test_checkpoint_resume_matches_uninterrupted_run(tmp_path, stop_after, round_settings):
    """4 steps straight == stop_after steps, stop, resume, the rest: parameters, AdamW state, scheduler,
    sampling RNG and adaptive beta. A round spans 2 optimizer steps, so stopping after step 1 resumes
    inside a generation round, whose remaining micro-batches must come from the checkpoint."""

    def run(output, stop=None, resume=None):
        args = make_config(
            output, max_steps=4, save_strategy="steps", save_steps=1, target_kl=0.001, **round_settings,
            **exact_resume(),
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=args,
            train_dataset=chat_dataset(16),
            processing_class=tiny_tokenizer(),
            callbacks=[StopAfter(stop)] if stop else None,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    run(tmp_path / "interrupted", stop=stop_after)
    resumed = run(tmp_path / "interrupted", resume=str(tmp_path / "interrupted" / f"checkpoint-{stop_after}"))
    # Same operations in the same order on the same machine: bit-identical, not just close.
    for (name, a), (_, b) in zip(
        straight.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    for a, b in zip(
        straight.optimizer.state_dict()["state"].values(),
        resumed.optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight.lr_scheduler.state_dict() == resumed.lr_scheduler.state_dict()
    assert resumed.beta == straight.beta != 0.04  # the controller moved beta, and resume restored it
