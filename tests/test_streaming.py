"""Iterable (streaming) train and eval datasets: group order, checks as rows come, the dataloader
settings a stream needs, eval datasets in dicts, resume and dynamic sampling on a stream."""

import logging
import math

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
from test_trainer import StopAfter
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, exact_resume, length_reward, make_config

from grpo_hf.data.batches import PromptChecker
from grpo_hf.data.streaming import ExtraStreamPrompts, GroupStream


def stream(n: int = 8) -> IterableDataset:
    return chat_dataset(n).to_iterable_dataset()


def text_rows(prompts: list) -> IterableDataset:
    """A stream from a generator (features unknown until read), readable again and again."""
    return IterableDataset.from_generator(_rows, gen_kwargs={"prompts": prompts})


def _rows(prompts):
    for i, prompt in enumerate(prompts):
        yield {"prompt": prompt, "answer": str(i)}


class RecordingTrainer(FixedCompletionsTrainer):
    """Keeps the answers of every generation round's rows (train and eval apart)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = {"train": [], "eval": []}

    def _sample_and_score(self, rows):
        self.rounds["train" if self.model.training else "eval"].append([int(r["answer"]) // 2 for r in rows])
        return super()._sample_and_score(rows)


def make_trainer(tmp_path, train_dataset, eval_dataset=None, reward=length_reward, **overrides):
    return RecordingTrainer(
        model=tiny_llama(),
        reward_funcs=reward,
        args=make_config(tmp_path, **overrides),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tiny_tokenizer(),
    )


def answers(rows) -> list[int]:
    return [int(row["answer"]) // 2 for row in rows]  # chat_dataset row i has answer 2 i


# ---- Group order --------------------------------------------------------------------------------


def test_group_stream_repeats_prompts_and_batches_and_crosses_passes():
    # 5 prompts, 2 per generation batch, G = 2, each batch for 2 micro-steps: the third batch takes
    # the last prompt of pass 0 and the first of pass 1 (nothing is dropped), and so on.
    rows = GroupStream(
        stream(5), PromptChecker("train_dataset", False), 2, prompts_per_batch=2, repeats=2, endless=True
    )
    got = []
    for row in rows:
        got.append(int(row["answer"]) // 2)
        if len(got) == 24:
            break
    assert got == [0, 0, 1, 1] * 2 + [2, 2, 3, 3] * 2 + [4, 4, 0, 0] * 2


def test_eval_group_stream_is_one_pass():
    rows = GroupStream(stream(3), PromptChecker("eval_dataset", False), 2)
    assert answers(rows) == [0, 0, 1, 1, 2, 2]


def test_repeated_rows_are_separate_objects():
    first, second = list(GroupStream(stream(1), PromptChecker("eval_dataset", False), 2))
    assert first == second and first["prompt"] is not second["prompt"]


def test_training_reads_the_stream_in_group_order(tmp_path):
    # G = 4, 8 completions per round = 2 prompts; 3 prompts: the second round spans two passes.
    trainer = make_trainer(tmp_path, stream(3), max_steps=3, shuffle_dataset=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.rounds["train"] == [[0] * 4 + [1] * 4, [2] * 4 + [0] * 4, [1] * 4 + [2] * 4]
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert trainer.args.accelerator_config.dispatch_batches is False


def test_a_stream_trains_as_its_map_style_dataset_does(tmp_path):
    """Unshuffled, 4 prompts read as a stream or indexed: the same rounds, the same parameters."""
    streamed = make_trainer(tmp_path / "s", stream(4), max_steps=2, shuffle_dataset=False)
    indexed = make_trainer(tmp_path / "m", chat_dataset(4), max_steps=2, shuffle_dataset=False)
    streamed.train()
    indexed.train()
    assert streamed.rounds == indexed.rounds
    for (name, a), (_, b) in zip(
        streamed.model.named_parameters(), indexed.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_shuffled_stream_is_reshuffled_each_pass_and_the_same_on_every_read(tmp_path):
    # 8 prompts, 2 per round: rounds 1-4 are pass 0, rounds 5-8 pass 1.
    one = make_trainer(tmp_path / "a", stream(8), max_steps=8)
    two = make_trainer(tmp_path / "b", stream(8), max_steps=8)
    for trainer in (one, two):
        trainer.train()
    assert one.rounds == two.rounds  # seeded: every process reads the same order
    order = [r[0] for r in one.rounds["train"]] + [r[4] for r in one.rounds["train"]]
    first_pass = sorted(order[:4] + order[8:12])
    assert first_pass == list(range(8))  # a pass holds each prompt once
    passes = [[r[0], r[4]] for r in one.rounds["train"]]
    assert passes[:4] != passes[4:]  # pass 1 is another order
    assert passes[:4] != [[0, 1], [2, 3], [4, 5], [6, 7]]  # and pass 0 is shuffled


# ---- Checks -------------------------------------------------------------------------------------


def test_a_stream_without_max_steps_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="max_steps"):
        RecordingTrainer(
            model="/no/such/model",  # loading it would raise FileNotFoundError
            reward_funcs=length_reward,
            args=make_config(tmp_path, max_steps=-1),
            train_dataset=stream(),
        )


@pytest.mark.parametrize("setting", ["dispatch_batches", "split_batches"])
def test_batching_settings_a_grpo_batch_cannot_use(tmp_path, setting):
    with pytest.raises(ValueError, match=setting):
        RecordingTrainer(
            model="/no/such/model",
            reward_funcs=length_reward,
            args=make_config(tmp_path, accelerator_config={setting: True}),
            train_dataset=chat_dataset(),  # map-style too: a batch of rows cannot be dispatched
        )


def test_a_stream_is_read_without_workers(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(tmp_path, stream(), dataloader_num_workers=2, max_steps=1)
    assert trainer.args.dataloader_num_workers == 0
    assert "dataloader_num_workers=2" in caplog.text
    assert trainer.get_train_dataloader().num_workers == 0


def test_an_eval_stream_keeps_the_map_style_train_set_workers(tmp_path):
    trainer = make_trainer(
        tmp_path,
        chat_dataset(),
        eval_dataset=stream(4),
        dataloader_num_workers=2,
        dataloader_persistent_workers=True,
        per_device_eval_batch_size=4,
    )
    assert trainer.get_train_dataloader().num_workers == 2
    assert trainer.get_eval_dataloader().num_workers == 0  # this loader only
    assert trainer.args.dataloader_num_workers == 2 and trainer.args.dataloader_persistent_workers


def test_stream_columns_are_checked_when_known_and_rows_as_they_come(tmp_path):
    no_prompt = Dataset.from_dict({"question": ["a", "b"]}).to_iterable_dataset()
    with pytest.raises(ValueError, match="no 'prompt' column"):
        make_trainer(tmp_path, no_prompt, max_steps=1)
    # Row 5 is chat, rows 0-4 text: construction reads nothing; training stops at row 5.
    mixed = text_rows(["a", "b", "c", "d", "e", [{"role": "user", "content": "f"}], "g", "h"])
    trainer = make_trainer(tmp_path, mixed, max_steps=4, shuffle_dataset=False)
    with pytest.raises(ValueError, match=r"train_dataset \(row 5 of the stream\).*mixes"):
        trainer.train()
    # Round 1 (rows 0-1) trained; Accelerate's loader reads one batch ahead, so reading round 3
    # (rows 4-5) stopped the run before round 2 (rows 2-3) trained.
    assert trainer.state.global_step == 1 and len(trainer.rounds["train"]) == 1


class ChangingStream:
    """A stream whose second pass differs: its row 1 is then a chat prompt among plain-text ones."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        second = [{"role": "user", "content": "b"}] if self.epoch == 1 else "b"
        return iter([{"prompt": "a"}, {"prompt": second}, {"prompt": "c"}])


def test_a_bad_row_is_named_by_its_place_in_its_pass():
    rows = GroupStream(ChangingStream(), PromptChecker("train_dataset", False), 1, endless=True)
    with pytest.raises(ValueError, match=r"train_dataset \(row 1 of pass 1 of the stream\).*mixes"):
        list(rows)  # not row 4: the three rows of pass 0 do not count


def test_an_empty_stream_is_named(tmp_path):
    trainer = make_trainer(tmp_path, text_rows([]), max_steps=1)
    with pytest.raises(ValueError, match="train_dataset is empty"):
        trainer.train()


# ---- Evaluation: streams, dicts, num_generations_eval ---------------------------------------------


@pytest.mark.parametrize(
    "kind", ["stream", "dataset_dict", "iterable_dataset_dict", "dict_of_datasets", "dict_of_streams"]
)
def test_eval_datasets_of_every_kind(tmp_path, kind):
    split = stream(3) if "stream" in kind or "iterable" in kind else chat_dataset(3)
    eval_dataset = {
        "stream": split,
        "dataset_dict": DatasetDict({"a": split, "b": split}),
        "iterable_dataset_dict": IterableDatasetDict({"a": split, "b": split}),
        "dict_of_datasets": {"a": split, "b": split},
        "dict_of_streams": {"a": split, "b": split},
    }[kind]
    trainer = make_trainer(tmp_path, chat_dataset(), eval_dataset=eval_dataset, per_device_eval_batch_size=4)
    metrics = trainer.evaluate()
    names = [""] if kind == "stream" else ["a_", "b_"]
    for name in names:
        assert math.isfinite(metrics[f"eval_{name}loss"])
        assert f"eval_{name}reward" in metrics  # GRPO metrics under the dataset's own prefix
    # Each eval prompt G = 4 times, each of the 3 prompts evaluated once per dataset.
    for rows in trainer.rounds["eval"]:
        assert all(rows.count(a) == 4 for a in rows)
    assert sorted(a for rows in trainer.rounds["eval"] for a in rows[::4]) == sorted([0, 1, 2] * len(names))


def test_a_dict_of_eval_datasets_is_checked_entry_by_entry(tmp_path):
    bad = Dataset.from_dict({"question": ["a"]})
    with pytest.raises(ValueError, match=r"eval_dataset\['b'\] has no 'prompt' column"):
        make_trainer(tmp_path, chat_dataset(), eval_dataset={"a": chat_dataset(), "b": bad})


@pytest.mark.parametrize("stream_eval", [False, True], ids=["map", "stream"])
def test_num_generations_eval_sets_the_eval_group_size(tmp_path, stream_eval):
    eval_dataset = stream(3) if stream_eval else chat_dataset(3)
    trainer = make_trainer(
        tmp_path,
        chat_dataset(),
        eval_dataset=eval_dataset,
        num_generations_eval=2,
        per_device_eval_batch_size=2,
    )  # 2 eval completions per step: not a multiple of num_generations=4, fine for groups of 2
    metrics = trainer.evaluate()
    assert all(rows[0] == rows[1] for rows in trainer.rounds["eval"])  # one group of 2 per batch
    assert len(trainer.rounds["eval"]) == 3
    # FixedCompletionsTrainer: rows 0 and 1 of a group get 2 and 3 tokens + EOS, so two different
    # rewards a != b: |r - mean| = |a - b| / 2 over the unbiased std |a - b| / sqrt(2) gives
    # 1 / sqrt(2) = 0.7071 (a little less: eps = 1e-4 joins the std, ~0.07 here).
    assert metrics["eval_advantage/abs_mean"] == pytest.approx(0.5**0.5, abs=3e-3)


def test_num_generations_eval_of_one_scores_with_advantage_zero(tmp_path):
    trainer = make_trainer(
        tmp_path,
        chat_dataset(),
        eval_dataset=chat_dataset(3),
        num_generations_eval=1,
        per_device_eval_batch_size=3,
    )
    metrics = trainer.evaluate()
    assert metrics["eval_advantage/abs_mean"] == 0.0  # a group of one has no relative advantage
    # A group of one has no std: the mean of the groups' stds has no value and is left out of the log
    # (reward_std is TRL's std over the whole batch, which three rewards do have).
    assert "eval_reward_std/group_mean" not in metrics
    assert math.isfinite(metrics["eval_loss"])


def test_the_eval_batch_must_hold_whole_eval_groups(tmp_path):
    with pytest.raises(ValueError, match="num_generations_eval=2"):
        make_trainer(
            tmp_path,
            chat_dataset(),
            eval_dataset=chat_dataset(),
            num_generations_eval=2,
            per_device_eval_batch_size=3,
        )


# ---- Resume and dynamic sampling on a stream --------------------------------------------------------


def test_resuming_a_stream_continues_where_it_stopped(tmp_path):
    """6 steps straight == 3 steps, stop, resume, 3 more: with 3 prompts and 2 per round the run
    crosses passes (each reshuffled), and the resumed run reads past the first pass exactly."""

    def run(output, stop=None, resume=None):
        trainer = make_trainer(
            output, stream(3), max_steps=6, save_strategy="steps", save_steps=1, **exact_resume()
        )
        if stop:
            trainer.add_callback(StopAfter(stop))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    first = run(tmp_path / "interrupted", stop=3)
    resumed = run(tmp_path / "interrupted", resume=str(tmp_path / "interrupted" / "checkpoint-3"))
    assert first.rounds["train"] + resumed.rounds["train"] == straight.rounds["train"]
    for (name, a), (_, b) in zip(
        straight.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def half_constant_reward(completions, answer, **kwargs) -> list[float]:
    """length_reward on prompts with answer 2 (mod 4), the same reward for every completion elsewhere."""
    lengths = length_reward(completions)
    return [value if int(a) % 4 == 2 else 1.0 for value, a in zip(lengths, answer, strict=True)]


def test_extra_stream_prompts_continue_from_any_position():
    extra = ExtraStreamPrompts(stream(5), seed=0, checker=PromptChecker("train_dataset", False))
    whole = answers(extra.take(0, 12))  # more than two passes
    assert sorted(whole[:5]) == list(range(5)) and sorted(whole[5:10]) == list(range(5))
    assert answers(extra.take(0, 4)) + answers(extra.take(4, 8)) == whole  # consecutive reads
    fresh = ExtraStreamPrompts(stream(5), seed=0, checker=PromptChecker("train_dataset", False))
    assert answers(fresh.take(7, 5)) == whole[7:]  # a resumed run starts at its saved position


def test_dynamic_sampling_draws_extra_prompts_from_the_stream(tmp_path):
    # Prompts with an even index give every completion the same reward: their groups are dropped
    # and replaced by groups of extra prompts until every kept group has a reward spread.
    trainer = make_trainer(
        tmp_path, stream(8), reward=half_constant_reward, max_steps=2, dynamic_sampling=True
    )
    trainer.train()
    extra = [entry["dynamic_sampling/extra_rounds"] for entry in trainer.state.log_history if "loss" in entry]
    assert sum(extra) > 0
    assert trainer.extra_rounds.position == 2 * sum(extra)  # 2 prompts per extra round
    rounds = trainer.rounds["train"]
    assert len(rounds) == 2 + sum(extra)  # each step: one regular round, then its extra rounds
    extra_rounds = rounds[1 : 1 + int(extra[0])] + rounds[2 + int(extra[0]) :]
    expected = ExtraStreamPrompts(stream(8), seed=0, checker=PromptChecker("train_dataset", False))
    assert [row[::4] for row in extra_rounds] == [
        answers(expected.take(2 * k, 2)) for k in range(len(extra_rounds))
    ]  # the extra stream's prompts, in order (seed 0), G = 4 rows each
