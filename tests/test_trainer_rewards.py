"""Reward settings through the trainer, as TRL 1.16 has them: multi_objective_aggregation (also with
dynamic sampling), scale_rewards booleans, the keywords reward functions get (trainer_state,
log_extra, log_metric), all-None rewards, reward_processing_classes, TRL's metric names, and the
completions table (printed, parquet, wandb, Hub upload with the Hub mocked).

FixedCompletionsTrainer gives the rows of each group of G = 4 completions of 3, 4, 5 and 6 ids
(2..5 pattern tokens and EOS), so rewards computed from the ids are known by hand."""

import logging
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, make_config

from grpo_hf.training import completion_logs
from grpo_hf.training.completion_logs import CompletionLog, HubUploader

ROWS = [0, 0, 0, 0, 1, 1, 1, 1]  # two prompts, G = 4


def id_count(completion_ids, **kwargs):
    """3, 4, 5, 6 in every group."""
    return [float(len(ids)) for ids in completion_ids]


def even_ids(completion_ids, **kwargs):
    """0, 1, 0, 1 in every group."""
    return [float(len(ids) % 2 == 0) for ids in completion_ids]


def odd_ids_doubled(completion_ids, **kwargs):
    """2, 0, 2, 0 in every group: with weights (1, 0.5) the weighted sum with even_ids is always 1."""
    return [2.0 * (len(ids) % 2) for ids in completion_ids]


def build(tmp_path, reward_funcs, **settings) -> FixedCompletionsTrainer:
    return FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=reward_funcs,
        args=make_config(tmp_path, **settings),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )


def first_round(trainer) -> dict:
    """The first round's batch, its tensors on the CPU (to compare with the tensors built here)."""
    trainer.model.train()
    batch = trainer._prepare_inputs([dict(row) for row in chat_dataset().select(ROWS)])
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# ---- Aggregation and scaling --------------------------------------------------------------------


def test_normalize_then_sum_through_the_trainer(tmp_path):
    settings = dict(reward_weights=[1.0, 0.5], beta=0.0)
    summed = build(tmp_path / "sum", [even_ids, odd_ids_doubled], **settings)
    assert torch.equal(first_round(summed)["advantages"], torch.zeros(8))  # every weighted sum is 1
    assert summed.metrics.values["train"]["frac_reward_zero_std"] == [1.0]
    gdpo = build(
        tmp_path / "gdpo",
        [even_ids, odd_ids_doubled],
        multi_objective_aggregation="normalize_then_sum",
        **settings,
    )
    # even_ids (0, 1, 0, 1): mean 0.5, std sqrt(1/3) -> -+0.5 / (0.5773503 + 1e-4) = -+0.8658754;
    # odd_ids_doubled (2, 0, 2, 0): mean 1, std sqrt(4/3) -> +-1 / (1.1547005 + 1e-4) = +-0.8659504.
    # Weighted: -+(0.8658754 - 0.5 * 0.8659504) = -+a, a = 0.4329002; over the batch of 8: mean 0,
    # unbiased std a * sqrt(8/7) = 0.4627898 -> advantage -+a / (0.4627898 + 1e-4) = -+0.9352123.
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4) - 0.5 / (math.sqrt(4 / 3) + 1e-4)
    b = a / (a * math.sqrt(8 / 7) + 1e-4)
    assert b == pytest.approx(0.9352123, rel=1e-6)
    expected = torch.tensor([-b, b, -b, b] * 2)  # (8,)
    torch.testing.assert_close(first_round(gdpo)["advantages"], expected, rtol=1e-5, atol=1e-6)
    logged = gdpo.metrics.values["train"]
    assert logged["frac_reward_zero_std"] == [0.0]
    assert logged["reward"] == [1.0]  # the logged reward is still the weighted sum of the raw rewards


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_dynamic_sampling_decides_on_the_aggregated_reward(tmp_path, aggregation):
    trainer = build(
        tmp_path, [even_ids, odd_ids_doubled], reward_weights=[1.0, 0.5], beta=0.0, max_steps=1,
        dynamic_sampling=True, max_dynamic_sampling_rounds=1, multi_objective_aggregation=aggregation,
    )  # fmt: skip
    trainer.train()
    logged = trainer.state.log_history[0]
    if aggregation == "sum_then_normalize":  # weighted sums all 1: no group teaches, the cap fills both
        assert logged["dynamic_sampling/extra_rounds"] == 1
        assert logged["dynamic_sampling/groups_filled"] == 2
    else:  # each group's normalised sum has a spread: the batch is kept as it is
        assert logged["dynamic_sampling/extra_rounds"] == 0
        assert logged["dynamic_sampling/groups_dropped"] == logged["dynamic_sampling/groups_filled"] == 0


@pytest.mark.parametrize(("scale", "divisor"), [(True, math.sqrt(5 / 3) + 1e-4), (False, 1.0)])
def test_scale_rewards_booleans_through_the_trainer(tmp_path, scale, divisor):
    trainer = build(tmp_path, id_count, scale_rewards=scale, beta=0.0)
    assert trainer.args.scale_rewards == ("group" if scale else "none")
    # Rewards 3, 4, 5, 6: mean 4.5, unbiased std sqrt(5/3) (True = 'group'); False = 'none': no division.
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5] * 2) / divisor  # (8,)
    torch.testing.assert_close(first_round(trainer)["advantages"], expected, rtol=1e-6, atol=1e-6)


# ---- Keywords reward functions get ----------------------------------------------------------------


class Curriculum:
    """Uses every keyword TRL hands over: reads the step, logs a column and a metric."""

    __name__ = "curriculum"

    def __init__(self):
        self.steps = []

    def __call__(self, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
        self.steps.append(trainer_state.global_step)
        log_extra("ids", [len(ids) for ids in completion_ids])
        log_metric("curriculum/step_plus_one", trainer_state.global_step + 1.0)
        return [float(len(ids)) for ids in completion_ids]


def test_trainer_state_log_extra_and_log_metric_reach_the_logs(tmp_path, capsys):
    reward = Curriculum()
    trainer = build(tmp_path, reward, max_steps=2, log_completions=True, beta=0.0)
    trainer.train()
    assert reward.steps == [0, 1]  # the step each round was scored at
    # log_metric: one value per round, logged at its step.
    assert [log["curriculum/step_plus_one"] for log in trainer.state.log_history[:2]] == [1.0, 2.0]
    table = Dataset.from_parquet(str(tmp_path / "_completions" / "completions_00001.parquet"))
    assert table.column_names == ["step", "prompt", "completion", "curriculum", "reward", "advantage", "ids"]
    assert table["ids"] == [3, 4, 5, 6] * 2 and table["step"] == [1] * 8  # the step it was logged at
    s = math.sqrt(5 / 3) + 1e-4  # rewards 3..6: std sqrt(5/3)
    assert table["advantage"] == pytest.approx([-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s] * 2, rel=1e-5)
    assert (tmp_path / "_completions" / "completions_00002.parquet").exists()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  [+")]
    assert len(printed) == 16  # num_completions_to_print None: every completion, at both logs
    assert "{'curriculum': 3.0, 'ids': 3}" in printed[0]


def test_all_none_rewards_warn_and_those_completions_get_advantage_zero(tmp_path, caplog):
    def length_unless_first_prompt(completion_ids, answer, **kwargs):
        return [None if a == "0" else float(len(ids)) for ids, a in zip(completion_ids, answer, strict=True)]

    trainer = build(tmp_path, length_unless_first_prompt, beta=0.0)
    with caplog.at_level(logging.WARNING, logger="grpo_hf.rewards.scoring"):
        advantages = first_round(trainer)["advantages"]
    assert (
        "All reward functions returned None for the following kwargs:\n"
        "{'answer': '0', 'prompt': [{'role': 'user', 'content': 'What is 0 + 0?'}], 'completion': ["
    ) in caplog.text  # TRL's words, the first unscored row's keyword arguments
    assert "Please ensure that at least one reward function returns a valid reward.\n4 of 8" in caplog.text
    s = math.sqrt(5 / 3) + 1e-4
    expected = torch.tensor([0.0] * 4 + [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s])  # (8,) prompt 0 unscored
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)
    assert trainer.metrics.values["train"]["reward"] == [4.5]  # prompt 1's rewards only


def test_a_reward_that_never_applies_trains_on_and_logs_no_reward(tmp_path):
    trainer = build(tmp_path, lambda completions, **kwargs: [None] * len(completions), max_steps=1)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert "reward" not in logged and "rewards/<lambda>/mean" not in logged  # no value: left out
    assert logged["frac_reward_zero_std"] == 1.0 and logged["advantage/abs_mean"] == 0.0
    assert math.isfinite(logged["loss"])


# ---- reward_processing_classes ------------------------------------------------------------------


def tiny_reward_model():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=259, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    return LlamaForSequenceClassification(config).eval()


def test_reward_processing_classes_one_or_a_list_and_an_attribute(tmp_path):
    tokenizer = tiny_tokenizer()
    one = FixedCompletionsTrainer(
        model=tiny_llama(), reward_funcs=tiny_reward_model(), reward_processing_classes=tokenizer,
        args=make_config(tmp_path), train_dataset=chat_dataset(), processing_class=tiny_tokenizer(),
    )  # fmt: skip
    assert one.reward_processing_classes == [tokenizer]
    mixed = FixedCompletionsTrainer(
        model=tiny_llama(), reward_funcs=[id_count, tiny_reward_model()],
        reward_processing_classes=[None, tokenizer], args=make_config(tmp_path),
        train_dataset=chat_dataset(), processing_class=tiny_tokenizer(),
    )  # fmt: skip
    assert mixed.reward_processing_classes == [None, tokenizer]


def test_a_reward_processing_classes_list_of_the_wrong_length_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match=r"reward_processing_classes has 1 entries for 2 reward.*must match"):
        FixedCompletionsTrainer(
            model="no-such-model", reward_funcs=[id_count, even_ids], reward_processing_classes=tiny_tokenizer(),
            args=make_config(tmp_path), train_dataset=chat_dataset(),
        )  # fmt: skip


# ---- TRL's metric names -------------------------------------------------------------------------


def test_trl_metric_names_are_logged_with_ours(tmp_path):
    trainer = build(tmp_path, id_count)
    batch = first_round(trainer)
    logged = {key: values[-1] for key, values in trainer.metrics.values["train"].items()}
    assert logged["rewards/id_count/mean"] == logged["reward/id_count"] == 4.5
    assert logged["rewards/id_count/std"] == pytest.approx(math.sqrt(10 / 7))  # 3..6 twice: squares 10, / 7
    assert logged["completions/mean_terminated_length"] == 4.5  # every row ended with EOS
    # num_tokens: prompt and completion tokens of the round; completions 3 + 4 + 5 + 6 per group.
    completion_tokens = batch["completion_mask"].sum().item()
    assert completion_tokens == 36
    assert logged["num_tokens"] == trainer.state.num_input_tokens_seen == batch["attention_mask"].sum().item()
    trainer.train()  # two steps, a round each (train() starts a fresh TrainerState)
    first, second = trainer.state.log_history[:2]
    for ours, trl in (("low", "low_mean"), ("high", "high_mean"), ("region", "region_mean")):
        assert second[f"clip_ratio/{trl}"] == second[f"clip_ratio/{ours}"]
    assert first["step_time"] > 0 and second["step_time"] > 0
    # A running total; every prompt of chat_dataset() has as many tokens as prompts 0 and 1.
    assert second["num_tokens"] == 2 * first["num_tokens"] == 2 * logged["num_tokens"]


# ---- The completions table ------------------------------------------------------------------------


def table_args(tmp_path, **settings):
    values = dict(
        output_dir=str(tmp_path), report_to=["wandb"], log_completions=True, num_completions_to_print=2,
        log_unique_prompts=True, log_completions_hub_repo=None, hub_private_repo=None,
    )  # fmt: skip
    return SimpleNamespace(**(values | settings))


def test_log_unique_prompts_keeps_one_row_per_prompt_in_the_wandb_table(tmp_path, monkeypatch, capsys):
    tables = []
    fake_wandb = SimpleNamespace(
        run=object(),
        Table=lambda columns, data: SimpleNamespace(columns=columns, data=data),
        log=lambda values, commit: tables.append(values["completions"]),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    log = CompletionLog(table_args(tmp_path), is_main_process=True)
    log.record([{"prompt": p, "completion": c, "reward": 1.0, "advantage": 0.0} for p in "ab" for c in "xyz"])
    log.flush(step=3)
    assert [row[1] for row in tables[0].data] == ["a", "b"]  # first row of each prompt
    assert tables[0].columns == ["step", "prompt", "completion", "reward", "advantage"]
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("  [")]) == 2
    assert len(Dataset.from_parquet(str(tmp_path / "_completions" / "completions_00003.parquet"))) == 6


class FakeHub:
    """Stands in for huggingface_hub.HfApi: records repos and uploads; can fail or hang."""

    def __init__(self, fail_uploads=0, create=None):
        self.repos, self.uploads, self.fail_uploads, self.create = [], [], fail_uploads, create

    def create_repo(self, repo_id, repo_type, private, exist_ok):
        if self.create is not None:
            self.create()
        self.repos.append((repo_id, repo_type, private, exist_ok))
        return SimpleNamespace(repo_id=f"me/{repo_id}")

    def upload_folder(self, repo_id, repo_type, folder_path, allow_patterns, commit_message):
        self.uploads.append((repo_id, repo_type, list(allow_patterns)))
        if self.fail_uploads:
            self.fail_uploads -= 1
            raise ConnectionError("hub unreachable")


def test_completions_go_to_a_hub_dataset_repo(tmp_path, monkeypatch):
    hub = FakeHub()
    monkeypatch.setattr("huggingface_hub.HfApi", lambda: hub)
    trainer = build(
        tmp_path, id_count, max_steps=2, log_completions=True, log_completions_hub_repo="completions"
    )
    assert hub.repos == [("completions", "dataset", None, True)]  # created with the trainer
    trainer.train()
    # Step 1's file at its log; step 2's at the end of training (uploads are UPLOAD_EVERY seconds apart).
    assert hub.uploads == [
        ("me/completions", "dataset", ["completions_00001.parquet"]),
        ("me/completions", "dataset", ["completions_00002.parquet"]),
    ]


def test_a_failed_upload_warns_and_its_files_go_up_with_the_next(tmp_path, caplog):
    hub = FakeHub(fail_uploads=1)
    (tmp_path / "completions_00001.parquet").write_bytes(b"1")
    uploader = HubUploader("completions", str(tmp_path), private=True, api=hub)
    with caplog.at_level(logging.WARNING, logger="grpo_hf.training.completion_logs"):
        uploader.upload()
        (tmp_path / "completions_00002.parquet").write_bytes(b"2")
        uploader.finish()
    assert "failed (ConnectionError: hub unreachable)" in caplog.text
    assert [files for _, _, files in hub.uploads] == [
        ["completions_00001.parquet"],
        ["completions_00001.parquet", "completions_00002.parquet"],
    ]
    assert uploader.uploaded == {"completions_00001.parquet", "completions_00002.parquet"}


def test_a_hub_repo_that_cannot_be_made_fails_before_the_model_loads(tmp_path, monkeypatch):
    def refuse():
        raise PermissionError("401 Unauthorized")

    monkeypatch.setattr("huggingface_hub.HfApi", lambda: FakeHub(create=refuse))
    args = make_config(tmp_path, log_completions=True, log_completions_hub_repo="completions")
    with pytest.raises(RuntimeError, match=r"log_completions_hub_repo='completions'.*401.*hf auth login"):
        FixedCompletionsTrainer(model="no-such-model", reward_funcs=id_count, args=args)


def test_a_hub_call_that_hangs_is_abandoned_after_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(completion_logs, "HUB_TIMEOUT", 0.2)
    hub = FakeHub(create=lambda: __import__("time").sleep(5))
    with pytest.raises(
        RuntimeError, match=r"CallTimeout: creating the Hub dataset repo .* did not return within 0.2 s"
    ):
        HubUploader("completions", str(tmp_path), private=None, api=hub)
