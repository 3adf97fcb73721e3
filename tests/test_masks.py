"""Off-policy sequence masking and high-entropy token masking, on hand-made batches."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from loss_settings import loss_settings

from grpo_hf import GRPOTrainer
from grpo_hf.algorithm.loss import LossSettings
from grpo_hf.algorithm.masks import gather_ragged, get_high_entropy_mask, get_off_policy_mask, policy_weights
from grpo_hf.algorithm.sampler_correction import SamplerCorrection

# ---- Off-policy sequence mask ------------------------------------------------------------------


def test_off_policy_mask_drops_negative_advantage_sequences_that_drifted():
    """threshold 0.5; mean log(pi_sampler / pi) over each row's 2 loss tokens (padding ignored):
    row 0: (1.0 + 0.4) / 2 = 0.7 but A >= 0: kept; row 1: 0.7 > 0.5 with A < 0: dropped;
    row 2: (0.5 + 0.3) / 2 = 0.4 <= 0.5: kept; row 3: exactly 0.5: kept (<=)."""
    logps = torch.zeros(4, 3)  # (B, T)
    sampler = torch.tensor([[1.0, 0.4, 9.0], [1.0, 0.4, 9.0], [0.5, 0.3, 9.0], [0.75, 0.25, 9.0]])  # (B, T)
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    keep = get_off_policy_mask(torch.tensor([0.0, -1.0, -1.0, -2.0]), logps, sampler, mask, 0.5)
    assert torch.equal(keep, torch.tensor([[1.0], [0.0], [1.0], [1.0]]))
    # (B, 1) advantages as TRL passes them give the same
    assert torch.equal(
        get_off_policy_mask(torch.tensor([[0.0], [-1.0], [-1.0], [-2.0]]), logps, sampler, mask, 0.5), keep
    )


def test_off_policy_mask_counts_an_unscored_token_as_no_divergence():
    # row: (NaN -> 0, 0.9) / 2 = 0.45 <= 0.5: kept, not dropped on the strength of a NaN
    keep = get_off_policy_mask(
        torch.tensor([-1.0]), torch.zeros(1, 2), torch.tensor([[math.nan, 0.9]]), torch.ones(1, 2), 0.5
    )
    assert keep.item() == 1.0


def test_off_policy_mask_has_no_gradient_path():
    logps = torch.zeros(1, 2, requires_grad=True)
    keep = get_off_policy_mask(torch.tensor([-1.0]), logps, torch.ones(1, 2), torch.ones(1, 2), 0.5)
    assert keep.item() == 0.0 and not keep.requires_grad


# ---- High-entropy mask -------------------------------------------------------------------------

ENTROPIES = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 0.2], [5.0, 6.0, 7.0]])  # (B, T)
# Row 0's last token is padding, row 2 a truncated completion masked out of the loss: neither counts.
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
# The loss tokens' entropies, sorted: 0.1, 0.2, 0.3, 0.5, 0.7 (positions 0..4).


@pytest.mark.parametrize(
    ("threshold", "kept"),
    [
        # quantile 0.8: position 3.2, 0.5 + 0.2 x (0.7 - 0.5) = 0.54 -> only 0.7
        (0.8, [[0, 0, 0], [0, 1, 0], [0, 0, 0]]),
        # quantile 0.5: position 2, 0.3 -> 0.5, 0.3 and 0.7
        (0.5, [[0, 1, 0], [1, 1, 0], [0, 0, 0]]),
        # quantile 0: the smallest, 0.1 -> every loss token
        (0.0, [[1, 1, 0], [1, 1, 1], [0, 0, 0]]),
        # quantile 1: the largest, 0.7 -> the highest token alone (TRL's top_entropy_quantile=0)
        (1.0, [[0, 0, 0], [0, 1, 0], [0, 0, 0]]),
    ],
)
def test_high_entropy_mask_keeps_tokens_at_or_above_the_quantile_of_loss_tokens(threshold, kept):
    mask = get_high_entropy_mask(ENTROPIES, MASK, threshold)
    assert mask.dtype == torch.bool
    assert mask.int().tolist() == kept
    # the same cut as torch.quantile's linear interpolation over the loss tokens
    cut = torch.quantile(ENTROPIES[MASK.bool()], threshold)
    assert torch.equal(mask, (ENTROPIES >= cut) & MASK.bool())


def test_high_entropy_quantile_is_over_every_process():
    """Another process holds 0.8, 0.9, 1.0: all eight sorted 0.1 0.2 0.3 0.5 0.7 0.8 0.9 1.0, quantile
    0.5 at position 3.5: 0.5 + 0.5 x 0.2 = 0.6 -> of this process's tokens only 0.7 stays."""
    other = torch.tensor([0.8, 0.9, 1.0])
    mask = get_high_entropy_mask(ENTROPIES, MASK, 0.5, gather=lambda values: torch.cat([values, other]))
    assert mask.int().tolist() == [[0, 0, 0], [0, 1, 0], [0, 0, 0]]


def test_high_entropy_mask_with_no_loss_token_anywhere_keeps_nothing():
    assert not get_high_entropy_mask(ENTROPIES, torch.zeros(3, 3), 0.5).any()


class TwoProcesses:
    """An accelerator's gather and pad_across_processes, with a second process holding `other`."""

    num_processes = 2

    def __init__(self, other: torch.Tensor):
        self.other = other

    def pad_across_processes(self, values: torch.Tensor, dim: int = 0) -> torch.Tensor:
        width = max(len(values), len(self.other))
        return torch.cat([values, values.new_zeros(width - len(values))])

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.long:  # the lengths
            return torch.cat([tensor, torch.tensor([len(self.other)])])
        return torch.cat([tensor, self.other, tensor.new_zeros(len(tensor) - len(self.other))])


def test_gather_ragged_keeps_each_process_values_and_drops_the_padding():
    mine = torch.tensor([0.5, 0.0])  # a real 0.0 must survive (no sentinel value)
    assert gather_ragged(TwoProcesses(torch.tensor([1.0, 2.0, 3.0])), mine).tolist() == [
        0.5,
        0.0,
        1.0,
        2.0,
        3.0,
    ]
    assert gather_ragged(TwoProcesses(torch.tensor([])), mine).tolist() == [0.5, 0.0]
    one = SimpleNamespace(num_processes=1)
    assert gather_ragged(one, mine) is mine


# ---- What the trainer passes to grpo_loss ------------------------------------------------------


def settings(correction: SamplerCorrection | None = None, **overrides) -> LossSettings:
    """A run's loss settings with `overrides` (GRPOConfig's names) and `correction` against the sampler."""
    return dataclasses.replace(loss_settings(**overrides), sampler_correction=correction)


def test_policy_weights_are_all_off_by_default():
    inputs = {"completion_mask": MASK, "advantages": torch.zeros(3), "dapo_normalizer": torch.tensor(7.0)}
    weights = policy_weights(settings(), torch.zeros(3, 3), ENTROPIES, torch.zeros(3, 3), inputs)
    assert weights == {
        "off_policy_mask": None,
        "entropy_mask": None,
        "sampler_weights": None,
        "entropy_normalizer": inputs["dapo_normalizer"],  # the bonus: a token mean over the optimizer step
    }


def test_with_the_high_entropy_mask_the_bonus_divides_by_the_kept_tokens_of_every_process():
    """Quantile 0.5 over this process's 0.1 0.2 0.3 0.5 0.7 and another's 0.8 0.9 1.0: cut 0.6, this
    process keeps 1 token, the other 3: 4 kept over 2 processes, 2 per process."""
    other = torch.tensor([0.8, 0.9, 1.0])

    def gather(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([values, other if len(values) > 1 else torch.tensor([3.0])])

    inputs = {"completion_mask": MASK, "advantages": torch.zeros(3), "dapo_normalizer": torch.tensor(7.0)}
    args = settings(top_entropy_quantile=0.5)
    weights = policy_weights(args, torch.zeros(3, 3), ENTROPIES, torch.zeros(3, 3), inputs, gather)
    assert weights["entropy_mask"].sum() == 1
    assert weights["entropy_normalizer"].item() == 2.0
    alone = policy_weights(args, torch.zeros(3, 3), ENTROPIES, torch.zeros(3, 3), inputs)
    assert alone["entropy_normalizer"].item() == 3.0  # 0.5, 0.3 and 0.7 at or above the median 0.3


def test_policy_weights_use_the_sampler_log_probs_where_recorded():
    """old = current (ratio 1); sampler log-probs 1 above them: divergence 1 > 0.5 drops the A < 0 row.
    Without sampler log-probs pi_old is the reference: divergence 0, kept. top_entropy_quantile 0.2 is
    the 0.8 quantile; sampler weights e^-1 per token, capped at 2 (no bound below)."""
    logps = torch.zeros(3, 3)
    inputs = {"completion_mask": MASK, "advantages": torch.tensor([1.0, -1.0, -1.0])}
    args = settings(
        SamplerCorrection("token_truncate", None, 2.0),
        off_policy_mask_threshold=0.5,
        top_entropy_quantile=0.2,
    )
    without = policy_weights(args, logps, ENTROPIES, logps, inputs)
    assert without["off_policy_mask"].flatten().tolist() == [1.0, 1.0, 1.0]
    assert without["sampler_weights"] is None  # nothing to correct against
    assert without["entropy_mask"].int().tolist() == [[0, 0, 0], [0, 1, 0], [0, 0, 0]]
    recorded = policy_weights(args, logps, ENTROPIES, logps, inputs | {"sampler_logps": logps + 1})
    assert recorded["off_policy_mask"].flatten().tolist() == [1.0, 0.0, 1.0]  # row 2: no loss token, mean 0
    torch.testing.assert_close(recorded["sampler_weights"], torch.exp(-MASK.float()))


# ---- TRL's public methods on the trainer -------------------------------------------------------


def test_trainer_off_policy_mask_is_trls_static_method_with_the_loss_values():
    """TRL's example: threshold 1, mean log(pi_sampler / pi) over 4 tokens 2, 0.5, 2 with advantages 1,
    -1, -1: kept (A >= 0), kept (0.5 <= 1), dropped; (B, 1) in the mask's dtype, as TRL returns it.
    The loss gets the same mask from `policy_weights`."""
    mask = torch.ones(3, 4)  # (B, T)
    advantages = torch.tensor([[1.0], [-1.0], [-1.0]])  # (B, 1)
    logps = torch.tensor([[-2.0], [-0.5], [-2.0]]).expand(3, 4)  # (B, T)
    sampler = torch.zeros(3, 4)
    keep = GRPOTrainer.get_off_policy_mask(advantages, logps, sampler, mask, 1.0)
    assert keep.dtype == torch.float32 and keep.tolist() == [[1.0], [1.0], [0.0]]
    as_ints = GRPOTrainer.get_off_policy_mask(advantages, logps, sampler, mask.long(), 1.0)
    assert as_ints.dtype == torch.long and as_ints.tolist() == [[1], [1], [0]]
    inputs = {"completion_mask": mask, "advantages": advantages.view(-1), "sampler_logps": sampler}
    internal = policy_weights(settings(off_policy_mask_threshold=1.0), logps, mask, logps, inputs)
    assert torch.equal(internal["off_policy_mask"], keep)


TRL_ENTROPIES = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])  # (B, T)
TRL_MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])  # 1.1 and 1.2 are padding


@pytest.mark.parametrize(
    ("threshold", "kept"),
    [
        # 10 loss tokens 0.1 .. 1.0; quantile 0.8 at position 7.2: 0.8 + 0.2 x 0.1 = 0.82 -> 0.9, 1.0
        (0.8, [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]]),
        # quantile 0.5 at position 4.5: 0.55 -> 0.6 .. 1.0
        (0.5, [[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 0, 0]]),
        (0.0, [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),  # every loss token
        (1.0, [[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]]),  # the highest loss token, 1.0
    ],
)
def test_trainer_high_entropy_mask_is_trls_method_with_the_loss_values(threshold, kept):
    """TRL's method and its test's values, called as TRL's test calls it (on an object holding only
    an accelerator); the loss's mask from `policy_weights` (top_entropy_quantile = 1 - threshold) is
    the same."""
    trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1))
    mask = GRPOTrainer.get_high_entropy_mask(trainer, TRL_ENTROPIES, TRL_MASK, threshold)
    assert mask.dtype == torch.bool and mask.int().tolist() == kept
    inputs = {"completion_mask": TRL_MASK, "advantages": torch.zeros(2)}
    args = settings(top_entropy_quantile=1.0 - threshold)
    zeros = torch.zeros(2, 6)
    if threshold > 0:  # top_entropy_quantile 1 turns the mask off
        assert torch.equal(policy_weights(args, zeros, TRL_ENTROPIES, zeros, inputs)["entropy_mask"], mask)


def test_trainer_high_entropy_mask_takes_the_quantile_over_every_process():
    """A second process holds 0.8, 0.9, 1.0 (as in test_high_entropy_quantile_is_over_every_process):
    the trainer's method gathers them through its accelerator, cut 0.6."""
    trainer = SimpleNamespace(accelerator=TwoProcesses(torch.tensor([0.8, 0.9, 1.0])))
    mask = GRPOTrainer.get_high_entropy_mask(trainer, ENTROPIES, MASK, 0.5)
    assert mask.int().tolist() == [[0, 0, 0], [0, 1, 0], [0, 0, 0]]
