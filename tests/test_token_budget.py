"""`token_budget`: the log-prob passes of a round cut by tokens, not rows: the old and reference
passes across the round's micro-batches, the policy pass within each micro-batch."""

import pytest
import torch
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, length_reward, make_config

from grpo_hf.algorithm.loss import aggregate
from grpo_hf.data.token_budget import balance_rows, budget_passes, rows_in_passes
from grpo_hf.training.logprob_passes import check_policy_passes
from grpo_hf.training.metrics import combined_pass_values


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


def test_rows_dealt_to_processes_by_hand():
    # One optimizer step of 4 rows per process: 10s on process 0, 40s on process 1 (40 against 160
    # tokens). The 40s go first, alternately from process 0 (a tie goes to the lower process), then
    # the 10s: 100 tokens each, the rows of each in global order.
    assert balance_rows([[10, 10, 10, 10], [40, 40, 40, 40]], 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # Two steps of 2 rows each: each step's rows are dealt among themselves (step 1: rows 0, 1, 4, 5).
    assert balance_rows([[10, 10, 40, 40], [40, 40, 10, 10]], 2) == [[0, 4, 2, 6], [1, 5, 3, 7]]
    assert balance_rows([[3, 1, 2]], 3) == [[0, 1, 2]]  # one process keeps its rows


def test_pass_losses_add_up_to_the_micro_batch_loss():
    """Rows 0 and 1-3 of a micro-batch as two passes, each dividing by the micro-batch's 4 rows and
    7 loss tokens: the sum of their aggregates is the micro-batch's, for every aggregation."""
    per_token = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [1.0, 1.0, 1.0], [2.0, 4.0, 0.0]])  # (4, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # 7 tokens
    by_hand = {
        "grpo": ((1 + 2) / 2 + 3 / 1 + 3 / 3 + 2 / 1) / 4,  # mean over sequences of their token means
        "luspo": (3 + 3 + 3 + 2) / 4,  # mean over sequences of their token sums
        "bnpo": 11 / 7,  # the micro-batch's token mean
        "dr_grpo": 11 / (4 * 3),  # sum / (rows x max_completion_length)
        "dapo": 11 / 7,  # sum / the step's tokens (here the micro-batch's)
    }
    for loss_type, expected in by_hand.items():
        whole = aggregate(per_token, mask, loss_type, 3)
        parts = sum(
            aggregate(per_token[rows], mask[rows], loss_type, 3, None, batch_rows=4, batch_tokens=mask.sum())
            for rows in (slice(0, 1), slice(1, 4))
        )
        assert whole.item() == pytest.approx(expected) and parts.item() == pytest.approx(expected), loss_type


def test_combined_pass_values_by_hand():
    """Two passes of 3 and 1 loss tokens: the loss shares add up, extremes are the extremes, token means
    weigh by tokens: kl (0.1 x 3 + 0.5 x 1) / 4 = 0.2."""
    first = ({"policy_loss": 0.25, "clip_ratio/high_max": 0.5, "sampler/ratio_min": 0.9}, {"kl": 0.1}, 3.0)
    second = ({"policy_loss": -0.5, "clip_ratio/high_max": 0.125, "sampler/ratio_min": 0.7}, {"kl": 0.5}, 1.0)
    once, means, tokens = combined_pass_values([first, second])
    assert once == {"policy_loss": -0.25, "clip_ratio/high_max": 0.5, "sampler/ratio_min": 0.7}
    assert means == {"kl": pytest.approx(0.2)} and tokens == 4.0
    assert combined_pass_values([first]) == first


def test_what_needs_the_whole_micro_batch_is_refused(tmp_path):
    args = make_config(tmp_path, token_budget=64)
    with pytest.raises(ValueError, match="DeepSpeed"):
        check_policy_passes(args, deepspeed=True, router_aux_coef=0.0)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        check_policy_passes(args, deepspeed=False, router_aux_coef=0.01)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        check_policy_passes(make_config(tmp_path, token_budget=64, top_entropy_quantile=0.5), False, 0.0)
    check_policy_passes(make_config(tmp_path), deepspeed=True, router_aux_coef=0.01)  # no budget: nothing cut


def train(tmp_path, budget: int | None, **settings) -> tuple[dict, list, FixedCompletionsTrainer]:
    """Two rounds of 2 micro-batches of 4 rows, each round trained twice (mu = 2: old log-probs; 4 optimizer
    steps), beta > 0 (reference log-probs), completions of 2 to 5 tokens; the trained weights, each
    log-prob pass (with or without grad, its rows), the trainer."""
    args = make_config(
        tmp_path / f"{budget}-{settings}", per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_iterations=2, optim="sgd", learning_rate=0.5, token_budget=budget, max_steps=4, **settings,
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

    def counted(model, batch, with_entropy=False, replay=True):
        passes.append(("policy" if torch.is_grad_enabled() else "no grad", batch["input_ids"].shape[0]))
        return scores(model, batch, with_entropy, replay)

    trainer.completion_logps = counted
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, passes, trainer


@pytest.mark.parametrize(
    "budget, loss_type",
    [(10_000, "dapo"), (1, "dapo"), (1, "grpo"), (1, "bnpo"), (1, "dr_grpo"), (1, "luspo")],
)
def test_budgeted_passes_train_as_the_micro_batch_passes(tmp_path, budget, loss_type):
    """The same updates, loss and KL as one pass per micro-batch (4 rows), for each way a loss type
    aggregates: under a budget of a whole round, its 8 rows in one no-grad pass and each micro-batch's
    policy pass whole; under a budget below any row, a pass per row, policy passes too (their
    backward passes but the last taken in compute_loss)."""
    plain, plain_passes, plain_trainer = train(tmp_path, None, loss_type=loss_type)
    budgeted, passes, trainer = train(tmp_path, budget, loss_type=loss_type)
    # Per round: (old, reference) x 2 micro-batches without grad, then 2 passes x 2 micro-batches with.
    assert plain_passes == ([("no grad", 4)] * 4 + [("policy", 4)] * 4) * 2
    rows = 8 if budget > 1 else 1  # the round's 8 rows at once, or each alone
    policy = [("policy", 4)] * 4 if budget > 1 else [("policy", 1)] * 16
    assert passes == ([("no grad", rows)] * (16 // rows) + policy) * 2
    for name, value in plain.items():
        torch.testing.assert_close(budgeted[name], value, rtol=1e-4, atol=1e-6, msg=name)
    logs = zip(trainer.state.log_history[:-1], plain_trainer.state.log_history[:-1], strict=True)
    for ours, theirs in logs:
        for key in ("loss", "kl", "policy_loss", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def test_trl_disables_token_budget_with_a_non_positive_value(tmp_path):
    assert make_config(tmp_path, token_budget=-1).token_budget is None
    assert make_config(tmp_path, token_budget=0).token_budget is None
