"""The log-prob passes of a generation round, and how `token_budget` cuts them by tokens.

Old log-probs (where the policy moves within the round) and reference log-probs (beta > 0) are
computed once per round, without gradient, before the loss; the policy's, with gradient, in the
loss of each micro-step.

Without `token_budget` each micro-batch is one pass. With it the passes are cut by tokens, not
rows (verl's `log_prob_max_token_len_per_gpu`, TRL's async `token_budget`): this process's rows of
the round, every micro-batch of it in order, go through the model in runs of consecutive rows of
at most `token_budget` tokens each (a row's tokens: its prompt's and its completion's; a longer
row is a pass of its own). Every process makes the same number of passes, as FSDP and ZeRO-3 need
(they gather the parameters at every forward): the fewest that fit the budget on the process that needs
most, each process cutting its rows into that many with the least largest pass
(`data.token_budget.rows_in_passes`). A row's log-probs do not depend on the other rows of its pass (each
distinct prompt runs once, completions see only their own prompt and tokens), so they equal the
per-micro-batch ones up to float rounding; short completions then share a pass instead of each
micro-batch paying for one.

The policy pass of a micro-step is cut the same way within its micro-batch (`policy_passes`; the
Trainer's micro-steps and optimizer steps are unchanged): runs of consecutive rows of at most
`token_budget` tokens, each forward and backward on its own (the trainer's `compute_loss` takes
the backward of all but the last), as many on every process for each micro-step. Each pass's
loss divides by the whole micro-batch's rows or loss tokens where its loss type takes a
per-micro-batch mean (`loss.aggregate`'s `batch_rows` / `batch_tokens`; DAPO's normaliser and
the entropy bonus's are the optimizer step's already), so the passes' losses and gradients add up
to the micro-batch's. That bounds the memory a micro-step's activations take by the budget rather
than by per_device_train_batch_size x the longest completion. Not with DeepSpeed (its engine
takes one backward per micro-step), the high-entropy mask (its quantile is over the whole
micro-batch) or a MoE router loss (not a sum over rows).

With several processes the round's rows are first dealt to them by tokens (`balanced_round`):
each process keeps as many rows of each optimizer step as before, but which rows is chosen so that
the processes' shares hold about as many tokens each (`data.token_budget.balance_rows`), so the process with
the long completions is not the one every other waits for. An optimizer step's rows stay its rows
and each process's micro-batches keep their row count, so the loss types' denominators, and the
gradients, are unchanged; not under bnpo, whose mean is over each micro-batch's own tokens.
"""

import torch

from grpo_hf.algorithm.policy_terms import POLICY_TERMS
from grpo_hf.algorithm.sampler_correction import on_policy_support
from grpo_hf.data.batches import trim_padding
from grpo_hf.data.token_budget import balance_rows, budget_passes, rows_in_passes
from grpo_hf.models.reference import reference_context


def balanced_round(trainer, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This process's rows of a training round after dealing every process's rows by tokens
    (`data.token_budget.balance_rows`), gathered from the others; the batch as it is in evaluation, on one
    process or under bnpo (see the module docstring)."""
    accelerator, args = trainer.accelerator, trainer.args
    bnpo = POLICY_TERMS[args.loss_type].aggregation == "batch_token_mean"
    if not trainer.model.training or accelerator.num_processes == 1 or bnpo:
        return batch
    step_rows = args.per_device_train_batch_size * min(
        args.gradient_accumulation_steps, args.steps_per_generation
    )
    tokens = accelerator.gather(batch["attention_mask"].sum(dim=1))  # (P * R,)
    rows = balance_rows(tokens.view(accelerator.num_processes, -1).tolist(), step_rows)[
        accelerator.process_index
    ]
    width = batch["completion_mask"].shape[1]  # this process's completion columns

    def everyones(values: torch.Tensor, pad_first: bool = False) -> torch.Tensor:
        """(P * R, ...) every process's rows, columns padded to the widest (prompts on the left)."""
        if values.dim() > 1:
            values = accelerator.pad_across_processes(values, dim=1, pad_index=0, pad_first=pad_first)
        return accelerator.gather(values)

    out = {}
    for key, values in batch.items():
        if key in (
            "input_ids",
            "attention_mask",
        ):  # (R, P + C): left-padded prompts, right-padded completions
            values = torch.cat([everyones(values[:, :-width], True), everyones(values[:, -width:])], dim=1)
        else:
            values = everyones(values)
        out[key] = values[rows]
    return out


def pass_logps(trainer, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` with one pass's (B, C) `old_logps` (if the policy moves within the round) and
    `ref_logps` (if beta > 0), no grad, in the loss's precision (the trainer's bf16 autocast); the
    sampler's log-probs put on pi_old's support where the truncation is replayed (`on_policy_support`)."""
    computed, kept = _logps(trainer, batch)
    return on_policy_support(batch | computed, kept)


def _logps(trainer, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(`old_logps` / `ref_logps` as `pass_logps` says, the (B, C) log-mass pi_old's replayed truncation keeps)."""
    out, kept = {}, None
    with torch.no_grad(), trainer.compute_loss_context_manager():
        if trainer.needs_old_logps():
            out["old_logps"], _, kept = trainer.completion_logps(trainer.model_wrapped, batch)
        if trainer.beta > 0:
            with reference_context(trainer.model, trainer.ref_model) as ref:
                out["ref_logps"] = trainer.completion_logps(ref, batch, replay=False)[0]
    return out, kept


def round_logps(trainer, batch: dict[str, torch.Tensor], token_budget: int) -> dict[str, torch.Tensor]:
    """`batch` with the round's (B, C) old and reference log-probs (as `pass_logps`), in passes of at
    most `token_budget` tokens, as many on every process; zeros past each row's pass width."""
    tokens = batch["attention_mask"].sum(dim=1).tolist()  # (B,) each row's prompt and completion tokens
    local = torch.tensor([budget_passes(tokens, token_budget)], device=batch["attention_mask"].device)
    passes = int(trainer.accelerator.gather(local).max())
    out: dict[str, torch.Tensor] = {}
    for rows in rows_in_passes(tokens, passes):
        part = trim_padding(
            {key: value[rows] for key, value in batch.items()}, trainer.args.pad_to_multiple_of
        )
        computed, kept = _logps(trainer, part)
        computed |= {"kept_log_mass": kept} if kept is not None else {}
        for name, values in computed.items():  # (R, C') each
            target = out.setdefault(name, values.new_zeros(batch["completion_mask"].shape))  # (B, C)
            target[rows, : values.shape[1]] = values
    kept = out.pop("kept_log_mass", None)
    return on_policy_support(batch | out, kept)


def check_policy_passes(args, deepspeed: bool, router_aux_coef: float) -> None:
    """With a token_budget, which cuts a micro-batch's policy pass: refuse what must see it whole."""
    if args.token_budget is None:
        return
    if deepspeed:
        raise ValueError(
            "token_budget cuts a micro-step's policy pass into several backward passes, and DeepSpeed's engine "
            "takes one backward per micro-step: unset token_budget (lower per_device_train_batch_size to bound "
            "memory) or train without DeepSpeed."
        )
    if args.top_entropy_quantile < 1.0 or router_aux_coef != 0.0:
        raise ValueError(
            "token_budget cuts a micro-step's policy pass by tokens, and the high-entropy mask's quantile "
            "(top_entropy_quantile < 1) or a MoE router loss (router_aux_loss_coef) is taken over the whole "
            "micro-batch: unset token_budget, or set top_entropy_quantile=1.0 and router_aux_loss_coef=0."
        )


def add_policy_passes(trainer, parts: list[dict[str, torch.Tensor]], token_budget: int) -> None:
    """Give each micro-batch whose policy pass needs cutting its cut: `pass_ends`, (k,) the end row of
    each of its k passes, k the fewest that fit the budget on the process that needs most."""
    tokens = [part["attention_mask"].sum(dim=1).tolist() for part in parts]  # (S, rows) per micro-batch
    local = torch.tensor([budget_passes(row_tokens, token_budget) for row_tokens in tokens])  # (S,)
    counts = trainer.accelerator.gather(local.to(trainer.accelerator.device)).view(-1, len(parts))  # (P, S)
    for part, row_tokens, passes in zip(parts, tokens, counts.max(dim=0).values.tolist(), strict=True):
        if passes > 1:
            ends = [rows.stop for rows in rows_in_passes(row_tokens, passes)]
            part["pass_ends"] = torch.tensor(ends, device=part["attention_mask"].device)


def policy_passes(batch: dict[str, torch.Tensor], multiple: int | None) -> list[dict]:
    """The micro-batch's policy passes: the micro-batch itself, or with `pass_ends` its runs of rows,
    each trimmed of padding (`pad_to_multiple_of`: `multiple`) and carrying the micro-batch's rows
    and loss tokens (`batch_rows`, `batch_tokens`) for the loss's denominators."""
    if "pass_ends" not in batch:
        return [batch]
    mask = batch["completion_mask"]  # (B, C)
    whole = {"batch_rows": mask.shape[0], "batch_tokens": mask.sum()}
    ends = batch["pass_ends"].tolist()
    passes = []
    for start, end in zip([0, *ends[:-1]], ends, strict=True):
        rows = {
            key: value[start:end] if value.dim() else value
            for key, value in batch.items()
            if key != "pass_ends"
        }
        passes.append(trim_padding(rows, multiple) | whole)
    return passes
