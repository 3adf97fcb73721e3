"""The entropy bonus's coefficient, fixed and adaptive, step by step by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from grpo_hf import GRPOTrainer
from grpo_hf.training.entropy_control import EntropyCoefficient


def settings(**kwargs) -> SimpleNamespace:
    defaults = dict(
        entropy_coef=0.0, use_adaptive_entropy=False, entropy_target=0.2, entropy_coef_delta=0.005,
        entropy_coef_min=0.0, entropy_coef_max=1.0,
    )  # fmt: skip
    return SimpleNamespace(**(defaults | kwargs))


def controller(**kwargs) -> tuple[EntropyCoefficient, list[dict]]:
    records: list[dict] = []
    return EntropyCoefficient(settings(**kwargs), reduce=lambda t: t, record=records.append), records


def test_a_fixed_coefficient_is_applied_as_set_and_logged_each_step():
    coef, records = controller(entropy_coef=0.01)
    coef.observe(torch.ones(1, 2), torch.ones(1, 2), None)  # not adaptive: nothing gathered
    assert coef.window is None
    coef.on_step_end(None, None, None)
    assert coef.applied() == 0.01 and records == [{"entropy_coef": 0.01}]
    off, records = controller()
    off.on_step_end(None, None, None)
    assert off.applied() == 0.0 and records == []  # no bonus: no entropy_coef metric (as TRL)


def test_adaptive_coefficient_follows_the_step_entropy():
    """Start 0.01, delta 0.005, target 0.5, bounds [0, 0.012]. No bonus before the first measurement;
    entropy 0.4 <= 0.5: up to min(0.015, 0.012) = 0.012, applied; 0.6 > 0.5: down to 0.007, not
    applied; 0.9: 0.002; 0.9: max(-0.003, 0) = 0; 0.5 (at the target): up to 0.005, applied."""
    coef, _ = controller(
        entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.5, entropy_coef_max=0.012
    )
    assert coef.enabled and coef.applied() == 0.0
    steps = []
    for entropy in (0.4, 0.6, 0.9, 0.9, 0.5):
        coef.update(entropy)
        steps += [coef.coef, coef.applied()]
    assert steps == pytest.approx([0.012, 0.012, 0.007, 0.0, 0.002, 0.0, 0.0, 0.0, 0.005, 0.005])
    assert controller(use_adaptive_entropy=True)[0].enabled  # adaptive from 0: still on


def test_the_step_entropy_is_the_token_mean_over_its_micro_batches_and_processes():
    """Micro-batch 1: entropies (1, 3) on 2 bonus tokens; micro-batch 2: (2, [4 masked], [6 outside the
    high-entropy mask]) -> 1 token. Summed by `reduce` with a second process holding (sum 10, 4 tokens):
    (1 + 3 + 2 + 10) / (2 + 1 + 4) = 16 / 7 = 2.2857 > target 2: coefficient 0.1 - 0.05."""
    sums = []

    def reduce(window: torch.Tensor) -> torch.Tensor:
        sums.append(window.tolist())
        return window + torch.tensor([10.0, 4.0])

    records: list[dict] = []
    args = settings(entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=2.0, entropy_coef_delta=0.05)
    coef = EntropyCoefficient(args, reduce=reduce, record=records.append)
    coef.observe(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), None)
    coef.observe(
        torch.tensor([[2.0, 4.0, 6.0]]), torch.tensor([[1, 0, 1]]), torch.tensor([[True, True, False]])
    )
    coef.on_step_end(None, None, None)
    assert sums == [[6.0, 3.0]]
    assert coef.last_entropy == pytest.approx(16 / 7)
    assert records == [{"entropy_coef": pytest.approx(0.05)}] and coef.window is None


def test_state_round_trip():
    coef, _ = controller(entropy_coef=0.3, use_adaptive_entropy=True)
    assert coef.state_dict() == {"entropy_coef": 0.3, "last_entropy": math.inf}
    other, _ = controller(use_adaptive_entropy=True)
    other.load_state_dict({"entropy_coef": 0.25, "last_entropy": 0.1})
    assert (other.coef, other.applied()) == (0.25, 0.25)


def test_the_trainers_entropy_coef_is_the_controllers_coefficient_applied_or_not():
    """TRL's `trainer.entropy_coef`: fixed, the setting; adaptive, the controller's current value even
    while the bonus is off (entropy 0.6 above the target 0.5: 0.01 - 0.005 = 0.005, applied 0)."""
    fixed, _ = controller(entropy_coef=0.01)
    assert GRPOTrainer.entropy_coef.fget(SimpleNamespace(entropy_control=fixed)) == 0.01
    adaptive, _ = controller(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.5)
    adaptive.update(0.6)
    assert GRPOTrainer.entropy_coef.fget(SimpleNamespace(entropy_control=adaptive)) == pytest.approx(0.005)
    assert adaptive.applied() == 0.0
