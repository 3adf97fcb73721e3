"""The loss as the trainer wires it: DAPO's denominator per optimizer step, evaluation, rounds with
nothing to learn. Expectations are hand-computed or come from the pure `grpo_loss` on the same batch."""

import math

import pytest
import torch
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, make_config

from grpo_hf.engine.logprobs import completion_logps
from grpo_hf.loss import grpo_loss
from grpo_hf.rollout import Rollout, completion_mask_after_eos


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
        completion_ids = torch.tensor(rows)  # (B, C)
        mask, truncated = completion_mask_after_eos(completion_ids, self.eos_token_ids)
        return Rollout(prompt_ids, prompt_mask, completion_ids, mask, truncated)


def test_dapo_normalises_each_optimizer_step_by_its_own_active_tokens(tmp_path):
    """Two optimizer steps per round (steps_per_generation 2, no accumulation): the first step's
    gradient is the token mean over its own micro-batch (18 tokens), not over half the round (24)."""
    trainer = LengthsTrainer(
        model=tiny_llama(),
        reward_funcs=token_count_reward,
        args=make_config(
            tmp_path,
            per_device_train_batch_size=4,
            steps_per_generation=2,
            max_steps=1,
            max_completion_length=10,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
            beta=0.0,
        ),  # fmt: skip
        train_dataset=chat_dataset(2),
        processing_class=tiny_tokenizer(),
    )
    trainer.lengths = [3, 4, 5, 6, 6, 7, 8, 9]  # group 0: 18 tokens, group 1: 30
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    first, second = trainer._buffer
    assert [float(first["dapo_normalizer"]), float(second["dapo_normalizer"])] == [18.0, 30.0]
    # The same step by hand: the pure loss on micro-batch 0 with its own token count, then SGD.
    model = tiny_llama()
    logps, _ = completion_logps(
        model, first["input_ids"], first["attention_mask"], first["completion_mask"].shape[1]
    )
    loss, _ = grpo_loss(logps, None, None, first["advantages"], first["completion_mask"], loss_type="dapo")
    loss.backward()
    moved = 0
    for name, param in model.named_parameters():
        update = trainer.model.get_parameter(name).detach() - before[name]
        torch.testing.assert_close(update, -0.5 * param.grad, rtol=1e-4, atol=1e-7, msg=name)
        moved += bool(update.abs().max() > 0)
    assert moved > 0


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
    assert metrics["eval_loss"] == pytest.approx(-5 / (18 * (math.sqrt(5 / 3) + 1e-4)), rel=1e-5)  # eps 1e-4


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_a_round_with_every_token_masked_has_loss_0_and_moves_nothing(tmp_path, loss_type):
    """Every completion is truncated (2 new tokens, none of them EOS) and masked: nothing to learn."""
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
    model, total, tokens, means = peaky_llama(), 0.0, 0.0, []
    for part in trainer._buffer:  # both micro-batches of the step, under the weights before it
        mask = part["completion_mask"]
        with torch.no_grad():
            _, entropy = completion_logps(
                model, part["input_ids"], part["attention_mask"], mask.shape[1], with_entropy=True
            )
        total, tokens = total + (entropy * mask).sum().item(), tokens + mask.sum().item()
        means.append((entropy * mask).sum().item() / mask.sum().item())
    assert tokens == 48
    assert trainer.state.log_history[0]["entropy"] == pytest.approx(total / tokens, rel=1e-5)
    assert total / tokens != pytest.approx(sum(means) / 2, rel=1e-3), means  # the two means differ
