"""The loss as the trainer wires it: DAPO's denominator per optimizer step, evaluation, rounds with
nothing to learn. Expectations are hand-computed or come from the pure `grpo_loss` on the same batch."""

import math

import pytest
import torch
from loss_settings import grpo_loss_with
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, make_config, suite_device
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer
from grpo_hf.data.rollout import Rollout, completion_mask_after_eos
from grpo_hf.engine.logprobs import completion_logps


def token_count_reward(completion_ids, **kwargs) -> list[float]:
    """Reward = completion tokens, EOS included: easy to compute advantages by hand."""
    return [float(len(ids)) for ids in completion_ids]


class LengthsTrainer(FixedCompletionsTrainer):
    """Row i of the generation batch gets `lengths[i % len(lengths)]` tokens, the last one EOS."""

    lengths: list[int] = []

    def generate_completions(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Rollout:
        eos, pad, width = (
            self.eos_token_ids[0],
            self.processing_class.pad_token_id,
            self.args.max_completion_length,
        )
        rows = []
        for i in range(len(prompt_ids)):
            n = self.lengths[i % len(self.lengths)]
            rows.append(([40 + (7 * t + i) % 150 for t in range(n - 1)] + [eos] + [pad] * width)[:width])
        completion_ids = torch.tensor(rows, device=prompt_ids.device)  # (B, C)
        mask, truncated = completion_mask_after_eos(completion_ids, self.eos_token_ids)
        return Rollout(prompt_ids, prompt_mask, completion_ids, mask, truncated)


def test_dapo_normalises_each_optimizer_step_by_its_own_active_tokens(tmp_path):
    """Two optimizer steps per round (steps_per_generation 2, no accumulation), replayed by hand
    with plain SGD: each step's gradient is the token mean over its own micro-batch (18 then 30
    tokens), not over half the round (24), and the second step's ratios use the old log-probs
    of the round's start."""
    trainer = LengthsTrainer(
        model=tiny_llama(),
        reward_funcs=token_count_reward,
        args=make_config(
            tmp_path,
            per_device_train_batch_size=4,
            steps_per_generation=2,
            max_steps=2,
            max_completion_length=10,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
            beta=0.0,
            lr_scheduler_type="constant",
        ),  # fmt: skip
        train_dataset=chat_dataset(2),
        processing_class=tiny_tokenizer(),
    )
    trainer.lengths = [3, 4, 5, 6, 6, 7, 8, 9]  # group 0: 18 tokens, group 1: 30
    trainer.train()
    first, second = trainer._buffer  # one round fed both steps
    assert [float(first["dapo_normalizer"]), float(second["dapo_normalizer"])] == [18.0, 30.0]
    # Replay: the pure loss on each micro-batch with its own token count, then p -= lr * grad.
    model = tiny_llama().to(suite_device())
    with torch.no_grad():
        old = completion_logps(
            model, second["input_ids"], second["attention_mask"], second["completion_mask"].shape[1]
        )[0]
    torch.testing.assert_close(second["old_logps"], old, rtol=1e-5, atol=1e-6)
    for part, old_logps in ((first, None), (second, old)):
        model.zero_grad()
        logps, _, _ = completion_logps(
            model, part["input_ids"], part["attention_mask"], part["completion_mask"].shape[1]
        )
        loss, _ = grpo_loss_with(
            logps, old_logps, None, part["advantages"], part["completion_mask"], loss_type="dapo"
        )
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 0.5 * param.grad
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            trainer.model.get_parameter(name).detach(), param.detach(), rtol=1e-4, atol=1e-6, msg=name
        )
    assert not torch.equal(model.lm_head.weight.cpu(), tiny_llama().lm_head.weight)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_eval_loss_is_the_token_mean_whatever_the_accumulation(tmp_path, accumulation):
    """Eval with mu = 1 and no KL: loss = -sum_i A_i n_i / sum_i n_i per batch. Rows get 3..6 tokens
    (reward = tokens), so A = (-1.5, -0.5, 0.5, 1.5) / std with std = sqrt(5/3) and the loss is
    -(-4.5 - 2 + 2.5 + 9) / sqrt(5/3) / 18 = -5 / (18 sqrt(5/3)) in every group (std + eps 1e-4)."""
    trainer = LengthsTrainer(
        model=tiny_llama(),
        reward_funcs=token_count_reward,
        args=make_config(
            tmp_path,
            gradient_accumulation_steps=accumulation,
            per_device_train_batch_size=8 // accumulation,
            per_device_eval_batch_size=8,
            beta=0.0,
        ),  # fmt: skip
        train_dataset=chat_dataset(),
        eval_dataset=chat_dataset(4),
        processing_class=tiny_tokenizer(),
    )
    trainer.lengths = [3, 4, 5, 6]
    metrics = trainer.evaluate()
    assert metrics["eval_reward"] == metrics["eval_reward/token_count_reward"] == 4.5
    assert metrics["eval_completions/mean_length"] == 4.5
    assert metrics["eval_loss"] == pytest.approx(-5 / (18 * (math.sqrt(5 / 3) + 1e-4)), rel=1e-5)  # eps 1e-4


def test_a_round_with_every_token_masked_has_loss_0_and_moves_nothing(tmp_path, loss_type="dapo"):
    """Every completion is truncated (2 new tokens, none of them EOS) and masked: nothing to learn.
    (The other loss types: test_loss.py::test_a_batch_with_no_active_token_anywhere_...)"""
    trainer = LengthsTrainer(
        model=tiny_llama(),
        reward_funcs=token_count_reward,
        args=make_config(
            tmp_path,
            max_completion_length=2,
            mask_truncated_completions=True,
            loss_type=loss_type,
            max_steps=1,
            optim="sgd",
            max_grad_norm=0.0,
        ),  # fmt: skip
        train_dataset=chat_dataset(2),
        processing_class=tiny_tokenizer(),
    )
    trainer.lengths = [3, 4, 5, 6]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["completions/clipped_ratio"] == 1.0
    assert logged["loss"] == 0.0
    assert "nonfinite_steps_skipped" not in logged
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name


def peaky_llama():
    """tiny_llama with a 30x larger output layer: token entropies far apart, not all near log(259)."""
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


def test_logged_entropy_is_the_token_mean_over_the_micro_batches(tmp_path):
    """Gradient accumulation over micro-batches of 18 and 30 tokens: the logged entropy weighs each
    token once, not each micro-batch's mean once."""
    trainer = LengthsTrainer(
        model=peaky_llama(),
        reward_funcs=token_count_reward,
        args=make_config(
            tmp_path,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=1,
            max_completion_length=10,
            beta=0.0,
        ),  # fmt: skip
        train_dataset=chat_dataset(2),
        processing_class=tiny_tokenizer(),
    )
    trainer.lengths = [3, 4, 5, 6, 6, 7, 8, 9]
    trainer.train()
    model, total, tokens, means = peaky_llama().to(suite_device()), 0.0, 0.0, []
    for part in trainer._buffer:  # both micro-batches of the step, under the weights before it
        mask = part["completion_mask"]
        with torch.no_grad():
            _, entropy, _ = completion_logps(
                model, part["input_ids"], part["attention_mask"], mask.shape[1], with_entropy=True
            )
        total, tokens = total + (entropy * mask).sum().item(), tokens + mask.sum().item()
        means.append((entropy * mask).sum().item() / mask.sum().item())
    assert tokens == 48
    assert trainer.state.log_history[0]["entropy"] == pytest.approx(total / tokens, rel=1e-5)
    assert total / tokens != pytest.approx(sum(means) / 2, rel=1e-3), means  # the two means differ


class RecordingLossTrainer(LengthsTrainer):
    """Keeps every micro-step's loss, inputs and the parameters it was computed with."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.calls.append((loss.item(), {k: v.clone() for k, v in inputs.items()}, params))
        return loss


LOSS_SETTINGS = {
    "token": dict(
        epsilon=0.05, epsilon_high=0.01, delta=1.02, beta=0.1, kl_estimator="k1", entropy_coef=0.01,
        loss_type="bnpo", scale_rewards="batch", use_bias_correction_kl=False,
    ),
    "sequence": dict(importance_sampling_level="sequence", epsilon=0.02, beta=0.0),
    "cispo": dict(loss_type="cispo", epsilon_high=1.001, beta=0.0),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=3.0, sapo_temperature_neg=0.3, beta=0.0),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.02, beta=0.0),
    "vespo": dict(
        loss_type="vespo", vespo_k_pos=0.5, vespo_lambda_pos=0.1, vespo_k_neg=0.5, vespo_lambda_neg=6.0, beta=0.0,
        learning_rate=3e-4,  # at 3e-2 sequence ratios reach e^20, where phi ~ 0 for any k, lambda
    ),
}  # fmt: skip
TRAINING_ONLY = {"scale_rewards", "learning_rate"}  # settings that do not reach grpo_loss
DEFAULTS = dict(
    epsilon=0.2, epsilon_high=None, delta=None, beta=0.0, kl_estimator="k3", entropy_coef=0.0,
    loss_type="dapo", importance_sampling_level="token", use_bias_correction_kl=True,
    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
    vespo_k_neg=3.0, vespo_lambda_neg=2.0,
)  # fmt: skip


@pytest.mark.parametrize("level", list(LOSS_SETTINGS))
def test_loss_settings_reach_the_loss(tmp_path, level):
    """mu = 2, two micro-batches per step: the second pass's losses (policy moved, ratios != 1)
    equal the pure grpo_loss with the configured settings on the same batch, recomputed here from
    the recorded parameters, and each setting changes the value (so none is silently dropped)."""
    settings = LOSS_SETTINGS[level]
    trainer = RecordingLossTrainer(
        model=peaky_llama(),
        reward_funcs=token_count_reward,
        args=make_config(
            tmp_path,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_iterations=2,
            max_steps=2,
            max_completion_length=10,
            **({"learning_rate": 0.03} | settings),
        ),  # fmt: skip
        train_dataset=chat_dataset(2),
        processing_class=tiny_tokenizer(),
    )
    trainer.lengths = [3, 4, 5, 6, 6, 7, 8, 9]
    trainer.calls = []
    trainer.train()
    assert len(trainer.calls) == 4
    # Rewards are the token counts 3..6 and 6..9: group means 4.5 and 7.5, group std sqrt(5/3).
    rewards = torch.tensor([3.0, 4, 5, 6, 6, 7, 8, 9])
    centred = rewards - torch.tensor([4.5] * 4 + [7.5] * 4)
    std = rewards.std() if settings.get("scale_rewards") == "batch" else torch.tensor(5 / 3).sqrt()
    advantages = torch.cat([trainer.calls[0][1]["advantages"], trainer.calls[1][1]["advantages"]])
    torch.testing.assert_close(advantages.cpu(), centred / (std + 1e-4))
    model = peaky_llama().to(suite_device())
    configured = {**DEFAULTS, **{k: v for k, v in settings.items() if k not in TRAINING_ONLY}}
    for recorded, inputs, params in trainer.calls[2:]:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(params[name])
            logps, entropy, _ = completion_logps(
                model,
                inputs["input_ids"],
                inputs["attention_mask"],
                inputs["completion_mask"].shape[1],
                with_entropy=True,
            )
        assert recorded == pytest.approx(pure_loss(logps, entropy, inputs, configured), rel=1e-5, abs=1e-7)
        for name in settings.keys() - TRAINING_ONLY - {"beta"}:
            changed = pure_loss(logps, entropy, inputs, {**configured, name: DEFAULTS[name]})
            assert changed != pytest.approx(recorded, rel=1e-4, abs=1e-6), f"{name} makes no difference here"


def pure_loss(logps, entropy, inputs, settings) -> float:
    """grpo_loss on a recorded micro-batch, with the trainer's other inputs: the entropy bonus is a
    token mean over the optimizer step, so it divides by the DAPO normaliser too."""
    loss, _ = grpo_loss_with(
        logps, inputs["old_logps"], inputs.get("ref_logps"), inputs["advantages"], inputs["completion_mask"],
        max_completion_length=10, entropy=entropy, dapo_normalizer=inputs["dapo_normalizer"],
        entropy_normalizer=inputs["dapo_normalizer"], **settings,
    )  # fmt: skip
    return loss.item()


def test_reference_sync_mixes_alpha_of_the_policy_into_the_reference(tmp_path):
    """TR-DPO after one optimizer step: ref <- 0.6 * policy + 0.4 * ref, by hand."""
    trainer = LengthsTrainer(
        model=tiny_llama(),
        reward_funcs=token_count_reward,
        args=make_config(
            tmp_path, max_steps=1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.6
        ),
        train_dataset=chat_dataset(2),
        processing_class=tiny_tokenizer(),
    )
    trainer.lengths = [3, 4, 5, 6]
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    trainer.train()
    policy = dict(trainer.model.named_parameters())
    moved = 0
    for name, param in reference.named_parameters():
        torch.testing.assert_close(param.detach(), 0.6 * policy[name].detach() + 0.4 * before[name], msg=name)
        moved += not torch.equal(param, before[name])
    assert moved > 0


def id_sum_reward(completion_ids, **kwargs) -> list[float]:
    """Varies between sampled completions of the same length."""
    return [float(sum(ids) % 7) for ids in completion_ids]


class GradCapture(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sampler_mismatch_is_logged_and_the_capped_weight_scales_the_gradient(tmp_path):
    """Real sampling from the fp32 policy itself: the sampler's and the trainer's log-probs agree,
    so the ratio is 1 and a cap of 0.5 halves the first step's gradient (beta 0, mu 1)."""
    runs = {}
    for cap in (None, 0.5):
        trainer = GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=id_sum_reward,
            args=make_config(
                tmp_path / str(cap), max_steps=1, beta=0.0, max_grad_norm=0.0, sampler_is_cap=cap
            ),
            train_dataset=chat_dataset(2),
            processing_class=tiny_tokenizer(),
        )
        capture = GradCapture()
        trainer.add_callback(capture)
        trainer.train()
        logged = trainer.state.log_history[0]
        assert logged["sampler/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert logged["sampler/ratio_max"] == pytest.approx(1.0, abs=1e-4)
        runs[cap] = capture.grads
    assert runs[None]["lm_head.weight"].abs().max() > 0
    for name, grad in runs[None].items():
        torch.testing.assert_close(runs[0.5][name], 0.5 * grad, rtol=1e-3, atol=1e-7, msg=name)
