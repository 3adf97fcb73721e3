"""`token_budget`: the old and reference log-prob passes of a round cut by tokens, not rows."""

import pytest
import torch
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, length_reward, make_config

from grpo_hf.data.batches import budget_passes, rows_in_passes


def test_passes_by_hand():
    tokens = [10, 30, 5, 5, 40, 10, 10]
    # Greedy under 50: 10+30+5+5 = 50 | 40+10 = 50 | 10: three passes.
    assert budget_passes(tokens, 50) == 3
    # The least largest pass of three runs is 45: 10+30+5 | 5+40 | 10+10 (44 needs four).
    assert rows_in_passes(tokens, 3) == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert budget_passes(tokens, 44) == 4
    # A row over the budget is a pass of its own; passes <= rows always fit.
    assert budget_passes([100, 1, 1], 50) == 2
    assert rows_in_passes([100, 1, 1], 2) == [slice(0, 1), slice(1, 3)]
    assert rows_in_passes(tokens, 7) == [slice(i, i + 1) for i in range(7)]
    # More passes than the least cap fills (another process needs them): the longest run halved.
    assert rows_in_passes([5, 5, 5, 5], 3) == [slice(0, 1), slice(1, 2), slice(2, 4)]


def train(tmp_path, budget: int | None) -> tuple[dict, int, FixedCompletionsTrainer]:
    """Two rounds of 2 micro-batches of 4 rows, each round trained twice (mu = 2: old log-probs; 4 optimizer
    steps), beta > 0 (reference log-probs), completions of 2 to 5 tokens; the trained weights, the rows of
    each no-grad pass, the trainer."""
    args = make_config(
        tmp_path / str(budget), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_iterations=2,
        optim="sgd", learning_rate=0.5, token_budget=budget, max_steps=4,
    )  # fmt: skip
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=args,
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    passes = []
    scores = trainer.completion_logps

    def counted(model, batch, with_entropy=False):
        if not torch.is_grad_enabled():
            passes.append(batch["input_ids"].shape[0])
        return scores(model, batch, with_entropy)

    trainer.completion_logps = counted
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, passes, trainer


@pytest.mark.parametrize("budget, rows_per_pass", [(10_000, [8]), (1, [1] * 8)], ids=["round", "row"])
def test_budgeted_passes_train_as_the_micro_batch_passes(tmp_path, budget, rows_per_pass):
    """The same updates and logged KL as one pass per micro-batch (4 rows): a whole round's 8 rows in one
    pass under a large budget, a pass per row under a budget below any row."""
    plain, plain_passes, plain_trainer = train(tmp_path, None)
    budgeted, passes, trainer = train(tmp_path, budget)
    assert plain_passes == [4] * 8  # 2 rounds x (old, reference) x 2 micro-batches
    assert passes == rows_per_pass * 4  # 2 rounds x (old, reference)
    for name, value in plain.items():
        torch.testing.assert_close(budgeted[name], value, rtol=1e-4, atol=1e-6, msg=name)
    for ours, theirs in zip(
        trainer.state.log_history[:-1], plain_trainer.state.log_history[:-1], strict=True
    ):
        assert ours["kl"] == pytest.approx(theirs["kl"], rel=1e-4, abs=1e-7)


def test_trl_disables_token_budget_with_a_non_positive_value(tmp_path):
    assert make_config(tmp_path, token_budget=-1).token_budget is None
    assert make_config(tmp_path, token_budget=0).token_budget is None
