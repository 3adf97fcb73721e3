"""The entropy bonus's coefficient: `entropy_coef` as set, or adaptive (Skywork-OR1, arXiv 2505.22312).

With `use_adaptive_entropy` the coefficient starts at `entropy_coef` and moves once per optimizer
step: up by `entropy_coef_delta` when that step's entropy was at or below `entropy_target`, down
by it otherwise, kept within [`entropy_coef_min`, `entropy_coef_max`]. The step's entropy is the
token mean over the tokens the bonus acts on (every loss token, or the high-entropy ones with
`top_entropy_quantile` < 1), over all of the step's micro-batches on every process. The bonus is
applied only while the last step's entropy is at or below the target, so none before the first
measurement: it engages when the policy's entropy collapses and not otherwise. Its state (the
coefficient and the last entropy) is saved in checkpoints (`state_dict`). As TRL 1.16 does.
"""

import math
from collections.abc import Callable

import torch
from transformers import TrainerCallback


class EntropyCoefficient(TrainerCallback):
    """The coefficient applied to the entropy bonus, updated after each optimizer step.

    `reduce` sums a tensor over processes; `record` takes the `entropy_coef` metric, recorded
    after every optimizer step while the bonus is on (a coefficient other than 0, or adaptive).
    """

    def __init__(
        self,
        args,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        record: Callable[[dict[str, float]], None],
    ):
        self.coef = args.entropy_coef
        self.adaptive = args.use_adaptive_entropy
        self.target, self.delta = args.entropy_target, args.entropy_coef_delta
        self.bounds = (args.entropy_coef_min, args.entropy_coef_max)
        self.last_entropy = math.inf  # no measurement yet: no bonus
        self.window: torch.Tensor | None = None  # (2,) entropy sum and tokens of the current step
        self.reduce, self.record = reduce, record

    @property
    def enabled(self) -> bool:
        return self.coef != 0.0 or self.adaptive

    def applied(self) -> float:
        """The coefficient the loss uses now."""
        return 0.0 if self.adaptive and self.last_entropy > self.target else self.coef

    def observe(self, entropy: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None) -> None:
        """Add a training micro-batch's (B, T) entropy over the tokens the bonus acts on (the (B, T)
        loss mask, times the high-entropy mask if any) to the optimizer step's."""
        if not self.adaptive:
            return
        tokens = mask if entropy_mask is None else mask * entropy_mask  # (B, T)
        stats = torch.stack([(entropy.detach() * tokens).sum(), tokens.sum().to(entropy.dtype)])  # (2,)
        self.window = stats if self.window is None else self.window + stats

    def update(self, entropy: float) -> None:
        """The controller's step, given the last optimizer step's entropy."""
        low, high = self.bounds
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, high)
        else:
            self.coef = max(self.coef - self.delta, low)
        self.last_entropy = entropy

    def on_step_end(self, args, state, control, **kwargs):
        if self.window is not None:
            total, tokens = self.reduce(self.window).tolist()
            self.window = None
            self.update(total / max(tokens, 1.0))
        if self.enabled:
            self.record({"entropy_coef": self.coef})

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = state["entropy_coef"], state["last_entropy"]
