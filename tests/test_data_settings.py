"""Data settings through the trainer: shuffle_dataset, data_seed, pad_to_multiple_of,
chat_template_kwargs, remove_unused_columns, auto_find_batch_size, and dataloader workers started
by spawn."""

import itertools
import pickle

import pytest
import torch
from datasets import Dataset
from tiny_models import CHAT_TEMPLATE, tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, length_reward, make_config
from transformers import HfArgumentParser

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.data.batches import GroupSampler, keep_rows, padded_to_multiple, trim_padding
from grpo_hf.data.rollout import Rollout, render_prompt, tokenize_prompts
from grpo_hf.data.streaming import group_stream
from grpo_hf.episodes.tools import Toolbox, ToolResultRenderer, render_tool_prompt
from grpo_hf.rewards.scoring import RewardModel, score_with_model

# A chat template that cannot render without the keyword `marker`, and writes it first.
MARKED_TEMPLATE = (
    "{% if marker is not defined %}{{ raise_exception('no marker') }}{% endif %}[{{ marker }}]"
    + CHAT_TEMPLATE
)


def marked_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = MARKED_TEMPLATE
    return tokenizer


class PromptRecordingTrainer(FixedCompletionsTrainer):
    """Keeps each round's prompt ids as generation received them, and the rows' answers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts, self.answers = [], []

    def _sample_and_score(self, rows):
        self.answers.append([int(row["answer"]) // 2 for row in rows])
        return super()._sample_and_score(rows)

    def generate_completions(self, prompt_ids, prompt_mask):
        self.prompts.append((prompt_ids, prompt_mask))
        return super().generate_completions(prompt_ids, prompt_mask)


def make_trainer(tmp_path, tokenizer=None, dataset=None, reward=length_reward, **overrides):
    return PromptRecordingTrainer(
        model=tiny_llama(),
        reward_funcs=reward,
        args=make_config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else chat_dataset(),
        processing_class=tokenizer or tiny_tokenizer(),
    )


# ---- shuffle_dataset ----------------------------------------------------------------------------


def test_group_sampler_without_shuffle_keeps_the_dataset_order():
    sampler = GroupSampler(5, num_generations=2, prompts_per_batch=2, repeats=1, seed=0, shuffle=False)
    assert list(sampler) == [0, 0, 1, 1, 2, 2, 3, 3]  # prompt 4 would start a partial batch: dropped
    sampler.set_epoch(1)
    assert list(sampler) == [0, 0, 1, 1, 2, 2, 3, 3]  # and no reshuffle per epoch


@pytest.mark.parametrize("shuffle", [False, True])
def test_shuffle_dataset_through_the_trainer(tmp_path, shuffle):
    trainer = make_trainer(tmp_path, max_steps=4, shuffle_dataset=shuffle)  # 8 prompts, 2 per round
    trainer.train()
    order = [rows[i] for rows in trainer.answers for i in (0, 4)]
    assert sorted(order) == list(range(8))
    assert (order == list(range(8))) is not shuffle


def data_orders(tmp_path, **seeds) -> dict[str, list[int]]:
    """Every prompt order the seeds set: the train and eval samplers, dynamic sampling's extra
    prompts, a stream's shuffle (each as prompt numbers, 8 prompts)."""
    trainer = make_trainer(tmp_path, **seeds)
    args = trainer.args
    stream = group_stream(chat_dataset().to_iterable_dataset(), args, "train_dataset", False, training=True)
    return {
        "train": list(trainer._get_train_sampler())[:: args.num_generations],
        "eval": list(trainer._get_eval_sampler(chat_dataset()))[:: args.num_generations_eval],
        "extra": [int(row["answer"]) // 2 for row in trainer.extra_rounds.source.take(0, 8)],
        "stream": [int(row["answer"]) // 2 for row in itertools.islice(stream, 0, 32, args.num_generations)],
    }


def test_data_seed_sets_every_data_order_and_seed_does_not_when_it_is_set(tmp_path):
    """TrainingArguments' data_seed: the seed of the data samplers, independent of the model's
    `seed`; unset, `seed` is used."""
    one = data_orders(tmp_path, seed=0, data_seed=1)
    assert all(sorted(order) == list(range(8)) for order in one.values())  # 8 prompts, each once
    two = data_orders(tmp_path, seed=0, data_seed=2)
    assert all(one[name] != two[name] for name in one)
    assert data_orders(tmp_path, seed=5, data_seed=1) == one
    assert data_orders(tmp_path, seed=1) == one  # data_seed None: the orders of seed


# ---- pad_to_multiple_of -------------------------------------------------------------------------


def test_padded_to_multiple_pads_prompts_left_and_completions_right_out_of_every_mask():
    result = Rollout(
        prompt_ids=torch.tensor([[5, 6, 7]]),
        prompt_mask=torch.tensor([[1, 1, 1]]),
        completion_ids=torch.tensor([[8, 9]]),
        completion_mask=torch.tensor([[1, 1]]),
        truncated=torch.tensor([False]),
        sampler_logps=torch.tensor([[-0.5, -0.25]]),
        tool_mask=torch.tensor([[0, 1]]),
    )
    padded = padded_to_multiple(result, 4, pad_token_id=0)
    assert padded.prompt_ids.tolist() == [[0, 5, 6, 7]] and padded.prompt_mask.tolist() == [[0, 1, 1, 1]]
    assert padded.completion_ids.tolist() == [[8, 9, 0, 0]]
    assert padded.completion_mask.tolist() == [[1, 1, 0, 0]]
    assert padded.sampler_logps.tolist() == [[-0.5, -0.25, 0.0, 0.0]]
    assert padded.tool_mask.tolist() == [[0, 1, 0, 0]]
    assert padded_to_multiple(result, None, 0) is result


def test_trim_padding_keeps_widths_at_the_multiple():
    # Prompt width 8 (5 all-padding columns), completion width 8 (real tokens up to column 2).
    batch = {
        "input_ids": torch.arange(16).view(1, 16),
        "attention_mask": torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1] + [1, 1, 1, 0, 0, 0, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0]]),
    }
    plain = trim_padding(batch)
    assert plain["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]  # 3 prompt + 3 completion columns
    padded = trim_padding(batch, multiple=4)
    assert padded["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]  # 4 + 4
    assert padded["completion_mask"].tolist() == [[1, 1, 1, 0]]


def test_tokenize_prompts_pads_to_the_multiple():
    tokenizer = tiny_tokenizer()
    ids, mask = tokenize_prompts(tokenizer, ["abc", "abcdefghij"], None, torch.device("cpu"), 8)
    assert ids.shape == (2, 16) and mask.sum(dim=1).tolist() == [3, 10]


def test_pad_to_multiple_of_shapes_every_batch_and_changes_no_log_prob(tmp_path):
    def first_batch(**overrides):
        trainer = make_trainer(tmp_path, **overrides)
        trainer.model.train()
        return trainer, trainer._prepare_inputs(
            [dict(row) for row in chat_dataset().select([0] * 4 + [1] * 4)]
        )

    trainer, padded = first_batch(pad_to_multiple_of=16)
    _, plain = first_batch()
    prompt_ids, _ = trainer.prompts[0]
    assert prompt_ids.shape[1] % 16 == 0  # generation's input
    completion_width = padded["completion_mask"].shape[1]
    assert completion_width % 16 == 0 and (padded["input_ids"].shape[1] - completion_width) % 16 == 0
    assert padded["input_ids"].shape[1] > plain["input_ids"].shape[1]
    # The same completions: the reference log-probs of their tokens do not depend on the padding.
    width = plain["completion_mask"].shape[1]
    torch.testing.assert_close(padded["ref_logps"][:, :width], plain["ref_logps"], rtol=1e-5, atol=1e-5)
    assert padded["completion_mask"][:, width:].sum() == 0


@pytest.mark.parametrize(
    ("value", "resolved"), [("auto", None), ("none", None), ("16", 16), (8, 8), (None, None)]
)
def test_pad_to_multiple_of_values(tmp_path, value, resolved):
    assert (
        make_config(tmp_path, pad_to_multiple_of=value).pad_to_multiple_of == resolved
    )  # "auto": 128 on Neuron


@pytest.mark.parametrize("value", ["sixteen", 0])
def test_pad_to_multiple_of_rejects_what_is_no_multiple(tmp_path, value):
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        make_config(tmp_path, pad_to_multiple_of=value)


def test_dict_settings_parse_from_the_command_line():
    (config,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(
        args=[
            "--output_dir", "x", "--use_cpu", "true", "--report_to", "none",
            "--pad_to_multiple_of", "64",
            "--chat_template_kwargs", '{"enable_thinking": false}',
            "--model_init_kwargs", '{"dtype": "bfloat16", "attn_implementation": "sdpa"}',
            "--num_generations_eval", "2", "--shuffle_dataset", "false",
        ]
    )  # fmt: skip
    assert config.pad_to_multiple_of == 64 and config.num_generations_eval == 2 and not config.shuffle_dataset
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert config.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "sdpa"}


# ---- chat_template_kwargs -----------------------------------------------------------------------


def test_chat_template_kwargs_reach_every_rendering_of_a_chat():
    tokenizer, kwargs = marked_tokenizer(), {"marker": "m"}
    prompt = [{"role": "user", "content": "hi"}]
    with pytest.raises(Exception, match="no marker"):
        render_prompt(tokenizer, prompt)
    assert (
        render_prompt(tokenizer, prompt, kwargs)
        == "[m]<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    schemas = Toolbox([length_tool], None).schemas[None]  # the shared tools' schemas
    assert render_tool_prompt(tokenizer, prompt, schemas, kwargs).startswith(
        "[m]<|im_start|>system\nYou can call"
    )
    ids = ToolResultRenderer(tokenizer, kwargs)([{"role": "tool", "name": "length_tool", "content": "5"}])
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    reward_model = RewardModel(tiny_reward_model(), tokenizer, "rm", chat_template_kwargs=kwargs)
    assert len(score_with_model(reward_model, [prompt], [[{"role": "assistant", "content": "x"}]])) == 1


def length_tool(text: str) -> int:
    """Counts characters.

    Args:
        text: The text.
    """
    return len(text)


def tiny_reward_model():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=259, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    return LlamaForSequenceClassification(config).eval()


def test_chat_template_kwargs_through_the_trainer(tmp_path):
    trainer = make_trainer(tmp_path, marked_tokenizer(), max_steps=1, chat_template_kwargs={"marker": "m"})
    trainer.train()
    prompt_ids, prompt_mask = trainer.prompts[0]
    text = trainer.processing_class.decode(prompt_ids[0][prompt_mask[0].bool()])
    assert text.startswith("[m]<|im_start|>user\nWhat is")


def test_chat_template_kwargs_through_a_tool_run(tmp_path):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i}?"}] for i in range(4)]})
    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=lambda completions, **kw: [float(len(c[-1]["content"])) for c in completions],
        args=make_config(
            tmp_path, max_steps=1, max_tool_calling_iterations=1, chat_template_kwargs={"marker": "m"}
        ),
        train_dataset=dataset,
        processing_class=marked_tokenizer(),
        tools=[length_tool],
    )
    trainer.train()  # the template raises on any rendering without the keyword
    assert trainer.state.global_step == 1


# ---- remove_unused_columns ----------------------------------------------------------------------


@pytest.mark.parametrize("remove", [False, True])
def test_remove_unused_columns_keeps_only_the_prompt(tmp_path, remove):
    received = []

    def reward(completions, **kwargs):
        received.append(sorted(kwargs))
        return length_reward(completions)

    for dataset in (chat_dataset(), chat_dataset().to_iterable_dataset()):  # map-style and stream
        trainer = GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=reward,
            args=make_config(tmp_path, max_steps=1, remove_unused_columns=remove),
            train_dataset=dataset,
            processing_class=tiny_tokenizer(),
        )
        trainer.train()
    extra = [] if remove else ["answer"]
    # TRL's keywords (trainer_state, log_extra, log_metric) reach a function that takes **kwargs.
    assert received == [extra + ["completion_ids", "log_extra", "log_metric", "prompts", "trainer_state"]] * 2


# ---- auto_find_batch_size ------------------------------------------------------------------------


def test_auto_find_batch_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        make_config(tmp_path, auto_find_batch_size=True)


# ---- dataloader workers started by spawn ---------------------------------------------------------


def test_the_collator_pickles():
    assert pickle.loads(pickle.dumps(keep_rows))([{"prompt": "a"}]) == [{"prompt": "a"}]


@pytest.mark.slow
def test_dataloader_workers_started_by_spawn(tmp_path):
    """Spawn (the default on macOS, Windows and Linux from Python 3.14) pickles the dataset and the
    collator into each worker; a lambda collator failed here."""
    trainer = make_trainer(
        tmp_path, max_steps=2, dataloader_num_workers=2, dataloader_multiprocessing_context="spawn"
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.get_train_dataloader().num_workers == 2
    assert len(trainer.answers) == 2 and all(len(set(rows[:4])) == 1 for rows in trainer.answers)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
