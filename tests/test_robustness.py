"""Bad input fails early with the setting named; faults during training lose nothing."""

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, length_reward, make_config
from transformers import TrainerCallback
from two_processes import launch_two_processes

from grpo_hf import GRPOConfig, GRPOTrainer, TrlParser
from grpo_hf.training import checkpoints
from grpo_hf.training.checkpoints import (
    STATE_FILE,
    checkpoint_to_resume,
    last_complete_checkpoint,
    write_state,
)


def build(
    tmp_path, trainer_class=FixedCompletionsTrainer, reward_funcs=length_reward, dataset=None, **overrides
):
    return trainer_class(
        model=tiny_llama(),
        reward_funcs=reward_funcs,
        args=make_config(tmp_path, **overrides),
        train_dataset=chat_dataset() if dataset is None else dataset,
        processing_class=tiny_tokenizer(),
    )


# ---- Bad input ---------------------------------------------------------------------------------


def test_dataset_without_prompt_column_names_the_columns(tmp_path):
    with pytest.raises(ValueError, match=r"no 'prompt' column \(columns: \['question', 'answer'\]\)"):
        build(tmp_path, dataset=Dataset.from_dict({"question": ["a"], "answer": ["b"]}))


def test_empty_dataset(tmp_path):
    with pytest.raises(ValueError, match="train_dataset is empty"):
        build(tmp_path, dataset=Dataset.from_dict({"prompt": []}))


def test_mixed_prompt_formats(tmp_path):
    rows = [{"prompt": "plain"}, {"prompt": [{"role": "user", "content": "chat"}]}]
    with pytest.raises(ValueError, match="mixes plain-text and chat-format"):
        build(tmp_path, dataset=rows)


def test_reward_weights_length_mismatch(tmp_path):
    with pytest.raises(ValueError, match="reward_weights has 2 values for 1 reward functions"):
        build(tmp_path, reward_weights=[1.0, 0.5])


def test_tokenizer_without_pad_token(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            train_dataset=chat_dataset(),
            processing_class=tokenizer,
        )


def test_lora_targets_that_do_not_exist(tmp_path):
    with pytest.raises(ValueError, match=r"target_modules=\{'c_attn'\} matches no module.*q_proj"):
        GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
            peft_config=LoraConfig(target_modules=["c_attn"]),
        )


def first_round(trainer):
    trainer.model.train()
    rows = [dict(r) for r in chat_dataset().select([0, 0, 0, 0, 1, 1, 1, 1])]
    return trainer._prepare_inputs(rows)


@pytest.mark.parametrize(
    ("returns", "message"),
    [
        (lambda n: [1.0] * (n - 1), r"'bad' returned 7 values for 8 completions"),
        (lambda n: ["1"] * n, r"'bad' returned '1' \(str\)"),
        (lambda n: [math.nan] * n, r"'bad' returned nan"),
        (lambda n: [math.inf] * n, r"'bad' returned inf"),
    ],
    ids=["length", "type", "nan", "inf"],
)
def test_bad_reward_values_name_the_function(tmp_path, returns, message):
    def bad(completions, **kwargs):
        return returns(len(completions))

    with pytest.raises(ValueError, match=message):
        first_round(build(tmp_path, reward_funcs=bad))


# ---- Faults during training --------------------------------------------------------------------


def picky_reward(completions, **kwargs):
    """Raises on completions of exactly 3 tokens' text (row 1 of every group in FixedCompletionsTrainer)."""
    out = []
    for c in completions:
        text = c[0]["content"]
        if len(text) == 3:
            raise KeyError("cannot score this one")
        out.append(float(len(text)))
    return out


def test_a_raising_reward_names_the_function_and_the_completion(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"'picky_reward' raised KeyError.*on completion \[\{'role': 'assistant'"
    ):
        first_round(build(tmp_path, reward_funcs=picky_reward))


def test_reward_error_policy_zero_scores_0_and_counts(tmp_path):
    trainer = build(tmp_path, reward_funcs=picky_reward, reward_error_policy="zero")
    first_round(trainer)
    assert trainer.metrics.values["train"]["reward_errors"] == [2.0]  # row 1 of each of the 2 groups


class NaNLoss(FixedCompletionsTrainer):
    """The loss is NaN on chosen optimizer steps (1-based)."""

    nan_steps: set[int] = set()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs)
        return loss * math.nan if self.state.global_step + 1 in self.nan_steps else loss


def test_nonfinite_step_is_skipped_and_counted(tmp_path):
    NaNLoss.nan_steps = {1}
    trainer = build(tmp_path, trainer_class=NaNLoss, max_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for name, param in trainer.model.named_parameters():
        assert torch.equal(before[name], param), f"{name} changed on a skipped step"
    assert trainer.state.log_history[0]["nonfinite_steps_skipped"] == 1.0


def test_nonfinite_steps_skipped_is_a_count_per_logging_interval(tmp_path):
    NaNLoss.nan_steps = {1, 3}  # not in a row: the run goes on
    trainer = build(tmp_path, trainer_class=NaNLoss, max_steps=4, logging_steps=4)
    trainer.train()
    assert trainer.state.log_history[0]["nonfinite_steps_skipped"] == 2.0


def test_too_many_nonfinite_steps_stop_with_a_clear_error(tmp_path):
    NaNLoss.nan_steps = {1, 2}
    trainer = build(tmp_path, trainer_class=NaNLoss, max_steps=4, max_nonfinite_steps=2)
    with pytest.raises(RuntimeError, match="2 optimizer steps in a row had non-finite gradients"):
        trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


class SendSignal(TrainerCallback):
    """SIGTERM arrives while the first optimizer step is running."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
    trainer = build(tmp_path, max_steps=5, save_strategy="steps", save_steps=100)
    trainer.add_callback(SendSignal())
    trainer.train()
    assert trainer.state.global_step == 1
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler removed after training


@pytest.mark.slow
def test_sigterm_reaching_one_of_two_processes_stops_both_after_the_same_step(tmp_path):
    """The signal reaches process 1 only (`kill <pid>`, some schedulers) as step 3 begins: at the
    end of step 3 both processes learn of it, both save checkpoint-3 and stop (gloo would abort on
    the mismatched collectives of one process saving while the other trains on)."""
    worker = Path(__file__).resolve().parent / "interrupt_worker.py"
    launch_two_processes(worker, [str(tmp_path)], tmp_path)
    for index in (0, 1):
        result = json.loads((tmp_path / f"process-{index}.json").read_text())
        assert result == {"stopped_after": [3], "global_step": 3}, f"process {index}"
    train = tmp_path / "train"
    assert sorted(p.name for p in train.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3"]
    assert last_complete_checkpoint(str(train)) == str(train / "checkpoint-3")  # grpo_state.json written
    assert json.loads((train / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = build(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=1)
    real_write = checkpoints.write_state

    def crash_on_second(folder, state):
        if folder.endswith("checkpoint-2"):
            raise OSError("disk full")
        real_write(folder, state)

    monkeypatch.setattr("grpo_hf.training.checkpoints.write_state", crash_on_second)
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    assert os.path.isfile(tmp_path / "checkpoint-1" / STATE_FILE)  # not rotated away
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    monkeypatch.undo()  # the disk has room again
    resumed = build(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=1)
    with pytest.raises(ValueError, match="checkpoint-2' is incomplete"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    resumed.train(resume_from_checkpoint=True)  # takes checkpoint-1
    assert resumed.state.global_step == 2


@pytest.mark.parametrize("flag", ["true", "True", "TRUE", "1"])
def test_resume_from_checkpoint_true_on_the_command_line_takes_the_newest_complete_one(tmp_path, flag):
    """The documented `--resume_from_checkpoint true` (docs/troubleshooting.md): TrainingArguments declares the setting a string."""
    (args,) = TrlParser(GRPOConfig).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--resume_from_checkpoint", flag, "--use_cpu", "--bf16", "false"]
    )
    assert args.resume_from_checkpoint == flag
    for step in (1, 2, 3):
        (tmp_path / f"checkpoint-{step}").mkdir()
    write_state(str(tmp_path / "checkpoint-2"), {})  # checkpoint-3 is incomplete (no grpo_state.json)
    assert checkpoint_to_resume(args.resume_from_checkpoint, str(tmp_path)) == str(tmp_path / "checkpoint-2")


@pytest.mark.parametrize("flag", ["false", "False", "0", "", None, False])
def test_resume_from_checkpoint_false_on_the_command_line_is_no_resume(tmp_path, flag):
    assert checkpoint_to_resume(flag, str(tmp_path)) is None


def test_resume_from_checkpoint_given_a_folder_takes_it(tmp_path):
    folder = str(tmp_path / "checkpoint-7")
    assert checkpoint_to_resume(folder, str(tmp_path)) == folder


def test_checkpoint_inside_a_round_holds_its_micro_batches(tmp_path):
    # Two optimizer steps per generation round: a checkpoint after step 1 is inside a round.
    trainer = build(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, num_iterations=2)
    trainer.train()
    assert (tmp_path / "checkpoint-1" / "grpo_round_0.pt").is_file()
    assert not (tmp_path / "checkpoint-2" / "grpo_round_0.pt").exists()  # end of a round: nothing pending
    (tmp_path / "checkpoint-1" / "grpo_round_0.pt").unlink()
    resumed = build(tmp_path, max_steps=2, num_iterations=2)
    with pytest.raises(ValueError, match="saved inside a generation round but has no grpo_round_0.pt"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


def test_a_policy_partitioned_at_load_by_zero3_cannot_be_copied_into_a_reference(tmp_path):
    model = tiny_llama()
    for param in model.parameters():
        param.ds_id = 0  # what DeepSpeed's zero.Init leaves on every parameter it partitions
    model.name_or_path = ""  # built from a config: nothing to load a reference from
    with pytest.raises(ValueError, match="partitioned by DeepSpeed ZeRO-3.*ref_model=.*peft_config"):
        GRPOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
        )
