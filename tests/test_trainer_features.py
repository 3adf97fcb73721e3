"""Trainer features beyond the core loop: reward models, a user-given reference, evaluation,
completion tables, masking of truncated completions."""

import math

import pytest
import torch
from peft import LoraConfig
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, length_reward, make_config
from transformers import LlamaConfig, LlamaForSequenceClassification, TrainerCallback

from grpo_hf.engine.logprobs import completion_logps
from grpo_hf.training.metrics import loss_values


def first_round(trainer):
    """The micro-batch of a first training round over 2 prompts x G = 4 completions."""
    trainer.model.train()
    return trainer._prepare_inputs([dict(row) for row in chat_dataset().select([0, 0, 0, 0, 1, 1, 1, 1])])


def tiny_reward_model() -> LlamaForSequenceClassification:
    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    return LlamaForSequenceClassification(config).eval()


def test_a_reward_model_scores_with_its_first_logit_and_is_logged_by_name(tmp_path):
    reward_model = tiny_reward_model()
    reward_model.name_or_path = "my-org/tiny-rm"
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=[length_reward, reward_model],
        reward_processing_classes=[None, tiny_tokenizer()],
        args=make_config(tmp_path, reward_weights=[0.0, 1.0]),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    batch = first_round(trainer)
    logged = trainer.metrics.values["train"]
    # The rewards are the model's first logit on the chat-rendered prompt + completion, computed
    # here one unpadded row at a time (score_with_model pads a batch and must agree).
    width = batch["completion_mask"].shape[1]
    ids = batch["input_ids"][:, -width:].masked_fill(batch["completion_mask"] == 0, 0)  # (8, C)
    tokenizer = tiny_tokenizer()
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    prompts = [row["prompt"] for row in chat_dataset().select([0, 0, 0, 0, 1, 1, 1, 1])]
    expected = []
    for prompt, text in zip(prompts, texts, strict=True):
        rendered = tokenizer.apply_chat_template(
            prompt + [{"role": "assistant", "content": text}], tokenize=False
        )
        row = torch.tensor(
            [tokenizer(rendered, add_special_tokens=False)["input_ids"]], device=reward_model.device
        )  # (1, L)
        with torch.no_grad():
            expected.append(reward_model(input_ids=row).logits[0, 0].item())
    assert len(set(expected)) > 1  # the completions score differently: the check can tell them apart
    assert logged["reward/tiny-rm"] == [pytest.approx(sum(expected) / len(expected), abs=1e-5)]
    assert logged["reward"] == logged["reward/tiny-rm"]  # weight 0 on length_reward
    assert not any(p.requires_grad for p in trainer.reward_funcs[1].model.parameters())


def test_a_user_given_reference_is_used_as_is_and_stays_frozen(tmp_path):
    reference = tiny_llama(seed=7)  # a different model than the policy, as in seed 003
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        ref_model=reference,
        args=make_config(tmp_path),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    batch = first_round(trainer)
    with torch.no_grad():
        want, _, _ = completion_logps(
            reference, batch["input_ids"], batch["attention_mask"], batch["ref_logps"].shape[1]
        )
    torch.testing.assert_close(batch["ref_logps"], want, rtol=1e-5, atol=1e-5)
    trainer.train()
    for name, param in reference.named_parameters():
        assert torch.equal(before[name], param.cpu()), f"reference {name} moved"


def test_evaluate_reports_loss_and_reward_metrics(tmp_path):
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, per_device_eval_batch_size=8),
        train_dataset=chat_dataset(),
        eval_dataset=chat_dataset(4),
        processing_class=tiny_tokenizer(),
    )
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    # FixedCompletionsTrainer: rows of a group get 2..5 pattern tokens + EOS, so the mean length is 4.5.
    assert metrics["eval_completions/mean_length"] == 4.5
    assert metrics["eval_reward"] > 0


def test_log_completions_prints_a_table_with_rewards(tmp_path, capsys):
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, max_steps=1, log_completions=True, num_completions_to_print=3),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  [+")]
    assert len(lines) == 3
    assert all("What is" in line and "->" in line for line in lines)


def test_mask_truncated_completions_drops_rows_without_eos(tmp_path):
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        # Rows get 2..5 tokens + EOS; with 4 new tokens at most, rows of 4 and 5 tokens are cut.
        args=make_config(tmp_path, max_completion_length=4, mask_truncated_completions=True),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    mask = first_round(trainer)["completion_mask"]
    assert mask.sum(dim=1).tolist() == [3, 4, 0, 0] * 2  # 2 tokens + EOS, 3 + EOS, then truncated rows


class GradCapture(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_same_gradient(tmp_path, lora):
    """Checkpointed layers (and, with LoRA, inputs that require grad) change memory, not the gradient;
    the reference pass (beta > 0) runs under the same setting."""
    grads = []
    for checkpointing in (False, True):
        capture = GradCapture()
        trainer = FixedCompletionsTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(
                tmp_path / str(checkpointing), max_steps=1, gradient_checkpointing=checkpointing
            ),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None,
            callbacks=[capture],
        )
        trainer.train()
        grads.append(capture.grads)
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    assert all("lora_" in name for name in plain) if lora else len(plain) > 20
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_metrics_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, report_to=["tensorboard"]),  # events under output_dir/runs/
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    events = EventAccumulator(str(next((tmp_path / "runs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward", "train/kl", "train/completions/mean_length", "train/reward/length_reward"} <= tags
    assert len(events.Scalars("train/reward")) == 2  # one point per optimizer step


def test_loss_metrics_reach_the_host_in_one_read(tmp_path, monkeypatch):
    """On a GPU every .item() waits for the device: a micro-step's metrics come back in one transfer."""
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    trainer.model.train()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    logps = torch.log(torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.4, 0.4]]))
    inputs = {
        "completion_mask": mask,
        "sampler_logps": torch.log(torch.tensor([[0.25, 0.4, 1], [0.1, 1, 1]])),
    }
    metrics = {"kl": torch.tensor(0.125), "entropy": torch.tensor(2.0)}
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a)
        )
    weights = torch.tensor([[2.0, 0.5, 9.0], [1.0, 9.0, 9.0]])  # the correction's, on the 3 active tokens
    trainer._record_loss_metrics([loss_values(metrics, logps, inputs, weights)])
    monkeypatch.undo()
    assert reads == ["tolist"]
    # ratios pi / pi_sampler on the 3 active tokens: 0.5 / 0.25, 0.2 / 0.4, 0.1 / 0.1
    values = trainer.metrics.values["train"]
    assert values["sampler/ratio_max"] == [pytest.approx(2.0)]
    assert values["sampling/sampling_logp_difference/max"] == [pytest.approx(math.log(2))]
    assert values["sampling/importance_sampling_ratio/min"] == [0.5]
    assert values["sampling/importance_sampling_ratio/max"] == [2.0]
    sums = trainer.metrics.token_sums["train"]
    assert sums["sampler/ratio_mean"] == [pytest.approx(3.5), 3.0]  # mean 3.5 / 3 over 3 tokens
    assert sums["sampling/importance_sampling_ratio/mean"] == [pytest.approx(3.5), 3.0]  # (2 + 0.5 + 1) / 3
    # |log ratio|: log 2, log 2, 0 -> mean 2 log 2 / 3
    assert sums["sampling/sampling_logp_difference/mean"] == [pytest.approx(2 * math.log(2)), 3.0]
    assert sums["kl"] == [pytest.approx(0.375), 3.0] and sums["entropy"] == [pytest.approx(6.0), 3.0]
    assert trainer.kl_control.round_kl == [0.125]
