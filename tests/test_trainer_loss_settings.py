"""Masks, the sampler's importance weights and the entropy bonus as the trainer wires them: tiny runs
whose recorded losses are recomputed by hand (masks from their definitions, not the trainer's code),
and the adaptive entropy coefficient across a checkpoint resume."""

import pytest
import torch
from loss_settings import grpo_loss_with
from test_trainer import StopAfter
from test_trainer_loss import RecordingLossTrainer, peaky_llama, token_count_reward
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, exact_resume, make_config, suite_device

from grpo_hf.engine.logprobs import completion_logps
from grpo_hf.training.checkpoints import read_state

LENGTHS = [3, 4, 5, 6, 6, 7, 8, 9]  # completion tokens per row, EOS included; reward = tokens


def recorded_run(tmp_path, trainer_class=RecordingLossTrainer, trainer_hook=None, **settings):
    """Two micro-batches of 4 per step, two steps, unless `settings` say otherwise."""
    defaults = dict(
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, max_completion_length=10,
        learning_rate=0.03, beta=0.0,
    )  # fmt: skip
    args = make_config(tmp_path, **(defaults | settings))
    trainer = trainer_class(
        model=peaky_llama(),
        reward_funcs=token_count_reward,
        args=args,
        train_dataset=chat_dataset(2),
        processing_class=tiny_tokenizer(),
    )
    trainer.lengths, trainer.calls = LENGTHS, []
    if trainer_hook:
        trainer_hook(trainer)
    trainer.train()
    return trainer


def replayed(params, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C) log-probs and entropy of a recorded micro-batch under its recorded parameters."""
    model = peaky_llama().to(suite_device())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(params[name])
        return completion_logps(
            model,
            inputs["input_ids"],
            inputs["attention_mask"],
            inputs["completion_mask"].shape[1],
            with_entropy=True,
        )[:2]


def test_off_policy_and_high_entropy_masks_reach_the_loss(tmp_path):
    """Second pass: a sequence with A < 0 whose mean log(pi_old / pi) is above 0 (the policy pushed it
    down) leaves the policy term; only tokens at or above the median entropy of the micro-batch's loss
    tokens keep theirs, and the entropy bonus is their mean entropy. No sampler log-probs here (fixed
    completions), so pi_old is the off-policy reference."""
    trainer = recorded_run(
        tmp_path, num_iterations=2, off_policy_mask_threshold=0.0, top_entropy_quantile=0.5, entropy_coef=0.01
    )
    dropped = 0
    for recorded, inputs, params in trainer.calls[2:]:
        logps, entropy = replayed(params, inputs)
        mask, advantages, old = inputs["completion_mask"], inputs["advantages"], inputs["old_logps"]
        drift = ((old - logps) * mask).sum(dim=1) / mask.sum(dim=1)  # (B,)
        keep = ((advantages >= 0) | (drift <= 0.0)).float().unsqueeze(1)  # (B, 1)
        kept = (entropy >= torch.quantile(entropy[mask.bool()], 0.5)) & mask.bool()  # (B, C)
        dropped += int((keep == 0).sum())
        assert 0 < kept.sum() < mask.sum()
        want, _ = grpo_loss_with(
            logps, old, None, advantages, mask, entropy=entropy, entropy_coef=0.01, max_completion_length=10,
            dapo_normalizer=inputs["dapo_normalizer"], off_policy_mask=keep, entropy_mask=kept,
        )  # fmt: skip
        assert recorded == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
        unmasked, _ = grpo_loss_with(
            logps, old, None, advantages, mask, entropy=entropy, entropy_coef=0.01, max_completion_length=10,
            dapo_normalizer=inputs["dapo_normalizer"],
        )  # fmt: skip
        assert recorded != pytest.approx(unmasked.item(), rel=1e-4)
    assert dropped > 0


class SamplerLogpsTrainer(RecordingLossTrainer):
    """Fixed completions with sampler log-probs: -20 per token on even rows (pi_old / pi_sampler
    beyond any cap), 0 on odd rows (pi_sampler = 1: the ratio is pi_old's probability, below 1)."""

    def generate_completions(self, prompt_ids, prompt_mask):
        result = super().generate_completions(prompt_ids, prompt_mask)
        rows = torch.arange(len(prompt_ids), device=prompt_ids.device).unsqueeze(1)  # (B, 1)
        result.sampler_logps = torch.where(rows % 2 == 0, -20.0, 0.0) * result.completion_mask  # (B, C)
        return result


def as_if_vllm_generated(trainer) -> None:
    """The loss side of vLLM generation without an engine (the completions and sampler log-probs come
    from SamplerLogpsTrainer): after __post_init__ vLLM generates exactly when generation_backend is
    'vllm', and the trainer then applies TRL's importance-sampling correction."""
    trainer.args.generation_backend = "vllm"
    trainer.loss_settings = trainer.args.loss_settings()


def test_vllm_sequence_mask_correction_reaches_the_loss_and_is_logged(tmp_path):
    """TRL's defaults when vLLM generates (sequence_mask, clip_max 3): even rows' ratio
    exp(sum_t (log pi_old + 20)) > 3, so their weight is 0; odd rows keep exp(sum_t log pi_old)."""
    trainer = recorded_run(tmp_path, SamplerLogpsTrainer, trainer_hook=as_if_vllm_generated, max_steps=1)
    weights_seen = []
    for recorded, inputs, params in trainer.calls:
        logps, entropy = replayed(params, inputs)  # mu = 1: pi_old is the current policy
        mask = inputs["completion_mask"]
        log_ratio = ((logps - inputs["sampler_logps"]) * mask).sum(dim=1, keepdim=True)  # (B, 1)
        weights = torch.where(log_ratio.exp() > 3.0, 0.0, log_ratio.exp()).expand_as(mask)  # (B, C)
        assert weights[0::2].eq(0).all() and weights[1::2].gt(0).all()
        want, _ = grpo_loss_with(
            logps, None, None, inputs["advantages"], mask, entropy=entropy, max_completion_length=10,
            dapo_normalizer=inputs["dapo_normalizer"], sampler_weights=weights,
        )  # fmt: skip
        assert recorded == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
        weights_seen.append(weights[mask.bool()])
    logged = trainer.state.log_history[0]
    every = torch.cat(weights_seen)
    assert logged["sampling/importance_sampling_ratio/min"] == 0.0
    assert logged["sampling/importance_sampling_ratio/max"] == pytest.approx(every.max().item(), rel=1e-5)
    assert logged["sampling/importance_sampling_ratio/mean"] == pytest.approx(every.mean().item(), rel=1e-5)
    assert logged["sampling/sampling_logp_difference/max"] == pytest.approx(20.0, abs=15)  # |log pi_old + 20|
    assert "sampler/ratio_mean" in logged


def test_our_decoder_ignores_the_vllm_settings(tmp_path):
    """Without vLLM, TRL's vllm_importance_sampling_* (on by default) do not apply: no weights."""
    trainer = recorded_run(tmp_path, SamplerLogpsTrainer, max_steps=1)
    assert trainer.loss_settings.sampler_correction is None
    assert not any(k.startswith("sampling/importance") for k in trainer.state.log_history[0])


def test_entropy_bonus_and_policy_loss_as_logged(tmp_path):
    """grpo's loss with entropy_coef 0.05 and one micro-batch per step: the logged loss is policy_loss
    minus 0.05 x the logged entropy (the micro-batch's token mean), not minus a per-sequence mean."""
    trainer = recorded_run(tmp_path, loss_type="grpo", entropy_coef=0.05, gradient_accumulation_steps=1)
    assert trainer.entropy_coef == 0.05  # TRL's attribute: the fixed coefficient
    for logged in trainer.state.log_history[:2]:
        assert logged["entropy_coef"] == pytest.approx(0.05)  # through a float32 reduction
        assert logged["loss"] == pytest.approx(logged["policy_loss"] - 0.05 * logged["entropy"], rel=1e-5)


def adaptive_run(output, stop=None, resume=None):
    """Adaptive entropy from 0 with a target no entropy reaches from below (100 nats): +0.01 per step."""
    args = make_config(
        output, max_steps=3, save_strategy="steps", save_steps=1, beta=0.0, use_adaptive_entropy=True,
        entropy_target=100.0, entropy_coef_delta=0.01, **exact_resume(),
    )  # fmt: skip
    trainer = RecordingLossTrainer(
        model=tiny_llama(),
        reward_funcs=token_count_reward,
        args=args,
        train_dataset=chat_dataset(16),
        processing_class=tiny_tokenizer(),
        callbacks=[StopAfter(stop)] if stop else None,
    )
    trainer.lengths, trainer.calls = LENGTHS, []
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_adaptive_entropy_survives_a_checkpoint_resume(tmp_path):
    """Step 1 applies no bonus (no entropy measured yet), step 2 applies 0.01, step 3 0.02; stopping
    after step 1 and resuming restores both the coefficient and the last entropy, so the resumed run
    ends bit-identical to the straight one (without the restore its step 2 would apply nothing)."""
    straight = adaptive_run(tmp_path / "straight")
    logs = [log for log in straight.state.log_history if "entropy_coef" in log]
    assert [log["entropy_coef"] for log in logs] == pytest.approx([0.01, 0.02, 0.03])
    for log, applied in zip(logs, [0.0, 0.01, 0.02], strict=True):
        assert log["loss"] == pytest.approx(log["policy_loss"] - applied * log["entropy"], rel=1e-5, abs=1e-7)
    assert straight.entropy_coef == pytest.approx(0.03)  # TRL's attribute: the controller's coefficient
    run_dir = tmp_path / "interrupted"
    stopped = adaptive_run(run_dir, stop=1)
    assert stopped.entropy_coef == pytest.approx(0.01)  # the controller's after step 1
    assert read_state(str(run_dir / "checkpoint-1"))["entropy"]["entropy_coef"] == pytest.approx(0.01)
    resumed = adaptive_run(run_dir, resume=str(run_dir / "checkpoint-1"))
    assert resumed.entropy_coef == pytest.approx(0.03)
    # the history holds step 1's record from the checkpoint, then the resumed steps: the same values
    again = [log for log in resumed.state.log_history if "entropy_coef" in log]
    assert [(log["entropy_coef"], log["loss"]) for log in again] == [
        (log["entropy_coef"], log["loss"]) for log in logs
    ]
    for (name, a), (_, b) in zip(
        straight.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
