"""Dynamic sampling (DAPO): zero-spread groups are replaced from extra rounds, up to a cap."""

import pytest
import torch
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, make_config

from grpo_hf import GRPOConfig
from grpo_hf.data.batches import extra_prompt_indices
from grpo_hf.data.rollout import Rollout
from grpo_hf.episodes.dynamic_sampling import select_groups, stack_rollouts

G = 4


# ---- Pure pieces -------------------------------------------------------------------------------


def test_select_groups_keeps_teaching_groups_in_order_then_fills_with_the_earliest_others():
    assert select_groups([False, True, False, True, True], needed=2) == ([1, 3], 0)
    # Only one teaching group for three places: the two earliest others fill, order kept.
    assert select_groups([False, True, False, False], needed=3) == ([0, 1, 2], 2)


def test_extra_prompt_stream_is_a_function_of_its_position():
    whole = extra_prompt_indices(num_prompts=5, seed=3, start=0, count=12)
    assert extra_prompt_indices(5, 3, 0, 7) + extra_prompt_indices(5, 3, 7, 5) == whole
    assert sorted(whole[:5]) == sorted(whole[5:10]) == list(range(5))  # each pass is a permutation
    assert whole[:5] != whole[5:10]  # passes are shuffled differently (fixed seed: checked once)
    assert extra_prompt_indices(5, 4, 0, 12) != whole


def test_stack_rollouts_pads_prompts_left_and_completions_right():
    a = Rollout(
        torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[7]]), torch.tensor([[1]]),
        torch.tensor([True]),
    )  # fmt: skip
    b = Rollout(
        torch.tensor([[8]]), torch.tensor([[1]]), torch.tensor([[9, 2]]), torch.tensor([[1, 1]]),
        torch.tensor([False]),
    )  # fmt: skip
    both = stack_rollouts([a, b], pad_token_id=0)
    assert both.prompt_ids.tolist() == [[5, 6], [0, 8]] and both.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert both.completion_ids.tolist() == [[7, 0], [9, 2]]
    assert both.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert both.truncated.tolist() == [True, False]
    assert both.sampler_logps is None  # not recorded (fixed completions)
    a.sampler_logps, b.sampler_logps = torch.tensor([[-0.5]]), torch.tensor([[-1.0, -2.0]])
    assert stack_rollouts([a, b], pad_token_id=0).sampler_logps.tolist() == [[-0.5, 0.0], [-1.0, -2.0]]


def test_config_checks_the_cap():
    with pytest.raises(ValueError, match="max_dynamic_sampling_rounds must be >= 1"):
        GRPOConfig(output_dir="x", use_cpu=True, num_generations=4, per_device_train_batch_size=8,
                   dynamic_sampling=True, max_dynamic_sampling_rounds=0)  # fmt: skip


# ---- In the trainer ----------------------------------------------------------------------------


class Recorder:
    """A reward that teaches only on chosen prompts and remembers which prompts it scored, per round."""

    def __init__(self, teaches):
        self.teaches = teaches  # answer (str) -> bool
        self.rounds: list[list[list[str]]] = []  # per generation round: per scoring call: answers
        self.__name__ = "recorded"

    def __call__(self, completion_ids, answer, **kwargs):
        self.rounds[-1].append(list(answer))
        # Rows of a group get 2..5 tokens from FixedCompletionsTrainer: spread only where it teaches.
        return [
            float(len(ids)) if self.teaches(a) else 1.0 for ids, a in zip(completion_ids, answer, strict=True)
        ]


class RoundTrainer(FixedCompletionsTrainer):
    """Marks the start of each generation round in the reward's record; keeps the rounds' batches."""

    def _generate_and_score(self, rows):
        self.reward_funcs[0].rounds.append([])
        parts = super()._generate_and_score(rows)
        self.batches = [*getattr(self, "batches", []), parts]
        return parts

    def _record_round(self, scored, *args):
        self.kept_prompts = [*getattr(self, "kept_prompts", []), scored.prompts]
        super()._record_round(scored, *args)


def build(tmp_path, reward, **overrides) -> RoundTrainer:
    settings = dict(dynamic_sampling=True, max_dynamic_sampling_rounds=4, max_steps=3, beta=0.0)
    settings.update(overrides)
    return RoundTrainer(
        model=tiny_llama(),
        reward_funcs=reward,
        args=make_config(tmp_path, **settings),
        train_dataset=chat_dataset(8),
        processing_class=tiny_tokenizer(),
    )


def groups_of(answers: list[str]) -> list[str]:
    """The prompt (by answer) of each group of G rows."""
    assert all(len(set(answers[i : i + G])) == 1 for i in range(0, len(answers), G))
    return answers[::G]


def test_the_batch_holds_only_teaching_groups_and_the_metrics_count_the_rest(tmp_path):
    reward = Recorder(teaches=lambda answer: int(answer) % 4 == 2)  # odd prompts teach: 4 of 8
    trainer = build(tmp_path, reward)
    trainer.train()
    assert len(trainer.batches) == 3
    for parts in trainer.batches:
        advantages = torch.cat([part["advantages"] for part in parts]).view(-1, G)  # (groups, G)
        assert (advantages != 0).any(dim=1).all(), "a group without spread reached the batch"
    extra = 0
    for step, calls in enumerate(reward.rounds):
        seen = [g for call in calls for g in groups_of(call)]
        zero_spread = sum(not reward.teaches(g) for g in seen)
        logged = trainer.state.log_history[step]
        assert logged["dynamic_sampling/extra_rounds"] == len(calls) - 1
        assert logged["dynamic_sampling/groups_dropped"] == zero_spread
        assert logged["dynamic_sampling/groups_filled"] == 0
        extra += len(calls) - 1
    assert extra > 0, "no round needed extra prompts: the test would not test them"


def test_at_the_cap_the_earliest_zero_spread_groups_fill_the_batch(tmp_path):
    reward = Recorder(teaches=lambda answer: answer == "2")  # only prompt 1 teaches
    trainer = build(tmp_path, reward, max_dynamic_sampling_rounds=2, max_steps=2)
    trainer.train()
    for step, calls in enumerate(reward.rounds):
        assert len(calls) == 3  # the regular round and the 2 extra rounds of the cap
        seen = [g for call in calls for g in groups_of(call)]
        teaching = [i for i, g in enumerate(seen) if reward.teaches(g)][:2]
        fillers = [i for i, g in enumerate(seen) if not reward.teaches(g)][: 2 - len(teaching)]
        kept = [str(2 * int(p[0]["content"].split()[2])) for p in trainer.kept_prompts[step]]
        assert groups_of(kept) == [seen[i] for i in sorted(teaching + fillers)]  # generation order
        logged = trainer.state.log_history[step]
        assert logged["dynamic_sampling/extra_rounds"] == 2
        assert logged["dynamic_sampling/groups_filled"] == len(fillers)
        zero_spread = sum(not reward.teaches(g) for g in seen)
        assert logged["dynamic_sampling/groups_dropped"] == zero_spread - len(fillers)
    assert {len(trainer.kept_prompts[0]), len(trainer.kept_prompts[1])} == {8}
    assert sum(log.get("dynamic_sampling/groups_filled", 0) for log in trainer.state.log_history) > 0


def test_resuming_continues_the_extra_prompt_stream(tmp_path):
    teaches = lambda answer: int(answer) % 4 == 2  # noqa: E731
    straight = build(tmp_path / "straight", Recorder(teaches), max_steps=4)
    straight.train()
    saving = build(tmp_path / "resumed", Recorder(teaches), max_steps=2, save_strategy="steps", save_steps=2)
    saving.train()
    resumed = build(tmp_path / "resumed", Recorder(teaches), max_steps=4)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.reward_funcs[0].rounds == straight.reward_funcs[0].rounds[2:]
    assert sum(len(calls) - 1 for calls in straight.reward_funcs[0].rounds[2:]) > 0  # extra rounds after it
