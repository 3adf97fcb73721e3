"""The no-grad log-prob passes of a generation round: old log-probs (where the policy moves within
the round) and reference log-probs (beta > 0), computed once per round, before the loss.

Without `token_budget` each micro-batch is one pass. With it the passes are cut by tokens, not
rows (verl's `log_prob_max_token_len_per_gpu`, TRL's async `token_budget`): this process's rows of
the round, every micro-batch of it in order, go through the model in runs of consecutive rows of
at most `token_budget` tokens each (a row's tokens: its prompt's and its completion's; a longer
row is a pass of its own). Every process makes the same number of passes, as FSDP and ZeRO-3 need
(they gather the parameters at every forward): the fewest that fit the budget on the process that needs
most, each process cutting its rows into that many with the least largest pass
(`batches.rows_in_passes`). A row's log-probs do not depend on the other rows of its pass (each
distinct prompt runs once, completions see only their own prompt and tokens), so they equal the
per-micro-batch ones up to float rounding; short completions then share a pass instead of each
micro-batch paying for one.
"""

import torch

from grpo_hf.data.batches import budget_passes, rows_in_passes, trim_padding
from grpo_hf.models.reference import reference_context


def pass_logps(trainer, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One pass's (B, C) `old_logps` (if the policy moves within the round) and `ref_logps` (if
    beta > 0): no grad, in the loss's precision (the trainer's bf16 autocast)."""
    out = {}
    with torch.no_grad(), trainer.compute_loss_context_manager():
        if trainer.needs_old_logps():
            out["old_logps"] = trainer.completion_logps(trainer.model_wrapped, batch)[0]
        if trainer.beta > 0:
            with reference_context(trainer.model, trainer.ref_model) as ref:
                out["ref_logps"] = trainer.completion_logps(ref, batch)[0]
    return out


def round_logps(trainer, batch: dict[str, torch.Tensor], token_budget: int) -> dict[str, torch.Tensor]:
    """The round's (B, C) old and reference log-probs (those `pass_logps` computes), in passes of at
    most `token_budget` tokens, as many on every process; zeros past each row's pass width."""
    tokens = batch["attention_mask"].sum(dim=1).tolist()  # (B,) each row's prompt and completion tokens
    local = torch.tensor([budget_passes(tokens, token_budget)], device=batch["attention_mask"].device)
    passes = int(trainer.accelerator.gather(local).max())
    out: dict[str, torch.Tensor] = {}
    for rows in rows_in_passes(tokens, passes):
        part = trim_padding(
            {key: value[rows] for key, value in batch.items()}, trainer.args.pad_to_multiple_of
        )
        for name, logps in pass_logps(trainer, part).items():  # (R, C') each
            target = out.setdefault(name, logps.new_zeros(batch["completion_mask"].shape))  # (B, C)
            target[rows, : logps.shape[1]] = logps
    return out
