"""beta, the KL penalty's coefficient: `beta` as set, or adaptive towards `target_kl` (seed 000).

With `target_kl` the coefficient follows a proportional controller (`algorithm.loss.adaptive_beta`,
over `kl_horizon` samples): at the start of each generation round, the mean of the previous round's
micro-step KL values, averaged over processes, moves it. Its state (beta and the round's KL values
so far) is saved in checkpoints (`state_dict`).
"""

from collections.abc import Callable

import torch

from grpo_hf.algorithm.loss import adaptive_beta


class KLControl:
    """The coefficient beta, and with target_kl the KL values a round observed.

    `reduce_mean` averages a tensor over processes.
    """

    def __init__(self, args, reduce_mean: Callable[[torch.Tensor], torch.Tensor]):
        self.beta = args.beta
        self.target_kl, self.horizon, self.samples = (
            args.target_kl,
            args.kl_horizon,
            args.generation_batch_size,
        )
        self.round_kl: list[float] = []  # this round's micro-step KL means, on this process
        self.reduce_mean = reduce_mean

    def observe(self, kl: float) -> None:
        """A training micro-step's mean KL to the reference."""
        self.round_kl.append(kl)

    def next_round(self) -> float:
        """beta for the round about to start (every process calls it: the KL is averaged over them)."""
        if self.target_kl is None or not self.round_kl:
            return self.beta
        kl = self.reduce_mean(torch.tensor(sum(self.round_kl) / len(self.round_kl))).item()
        self.beta = adaptive_beta(self.beta, kl, self.target_kl, self.samples, self.horizon)
        self.round_kl = []
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta, "round_kl": list(self.round_kl)}

    def load_state_dict(self, state: dict) -> None:
        self.beta, self.round_kl = state["beta"], list(state["round_kl"])
