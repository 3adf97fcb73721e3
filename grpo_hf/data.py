"""The prompt dataset on its way into a generation round: checks, group sampling, micro-batches.

- `check_prompt_dataset`: a dataset the trainer cannot use fails before any model work, naming
  the column to fix.
- `GroupSampler`: each prompt repeated G times, in the same order on every process.
- `extra_prompt_indices`: the prompts of dynamic sampling's extra rounds, a second shuffled stream.
- `split_batch` / `trim_padding`: a generation batch cut into micro-batches with no all-padding
  columns.
"""

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def check_prompt_dataset(dataset, name: str, needs_chat: bool = False, prompt_optional: bool = False) -> None:
    """Fail early, naming the column, on a dataset the trainer cannot use.

    `needs_chat`: tools are in use, so prompts must be chat messages (the chat template describes the
    tools and renders their results) and no column may be named 'environments' (the reward
    functions' keyword for the episodes' environments). `prompt_optional`: environments may supply
    the prompts (their `reset` returns them), so a dataset without a 'prompt' column is fine."""
    columns = getattr(dataset, "column_names", None)
    has_prompt = columns is None or "prompt" in columns
    if not has_prompt and not prompt_optional:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}); rename the prompt column to 'prompt'."
        )
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty.")
    if needs_chat and columns is not None and "environments" in columns:
        raise ValueError(
            f"{name} has a column named 'environments', the keyword that hands reward functions the episodes' "
            "environments; rename the column."
        )
    if not has_prompt:
        return
    prompts = dataset["prompt"] if columns is not None else [row["prompt"] for row in dataset]
    kinds = {"text" if isinstance(p, str) else "chat" if _is_chat(p) else type(p).__name__ for p in prompts}
    if kinds - {"text", "chat"}:
        raise ValueError(
            f"{name}: 'prompt' must be a string or a list of {{'role', 'content'}} messages; found {kinds - {'text', 'chat'}}."
        )
    if len(kinds) > 1:
        raise ValueError(
            f"{name}: 'prompt' mixes plain-text and chat-format rows; use one format for all rows."
        )
    if needs_chat and kinds == {"text"}:
        raise ValueError(
            f"{name}: tools and environments need chat prompts (a list of {{'role', 'content'}} messages in 'prompt'), since the "
            "chat template describes the tools and renders their results; found plain text."
        )


def _is_chat(prompt: object) -> bool:
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    )


class GroupSampler(Sampler[int]):
    """Shuffled prompt indices, each repeated G times, each generation batch repeated `repeats` times.

    Every process builds the same sequence from the same seed; Accelerate hands each process its
    own contiguous slice of every generation batch.
    """

    def __init__(
        self, num_prompts: int, num_generations: int, prompts_per_batch: int, repeats: int, seed: int
    ):
        self.num_prompts, self.num_generations = num_prompts, num_generations
        self.prompts_per_batch, self.repeats, self.seed = prompts_per_batch, repeats, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_prompts, generator=generator).tolist()
        usable = len(order) - len(order) % self.prompts_per_batch
        for start in range(0, usable, self.prompts_per_batch):
            batch = [
                i for i in order[start : start + self.prompts_per_batch] for _ in range(self.num_generations)
            ]
            for _ in range(self.repeats):
                yield from batch

    def __len__(self) -> int:
        return (
            (self.num_prompts // self.prompts_per_batch)
            * self.prompts_per_batch
            * self.num_generations
            * self.repeats
        )


EXTRA_STREAM_SEED = 2**31  # the extra stream's pass k shuffles with seed + 2**31 + k: no epoch's seed


def extra_prompt_indices(num_prompts: int, seed: int, start: int, count: int) -> list[int]:
    """Positions `start .. start + count - 1` of an endless stream of shuffled prompt indices.

    Dynamic sampling's extra rounds draw their prompts here, not from the `GroupSampler`, so the
    Trainer's epochs and steps stay as they are. The stream is a sequence of passes over the
    dataset, pass k shuffled with its own seed; a position depends only on (seed, position), so
    a run resumed from a checkpoint continues it from the saved count. A prompt may come up both
    here and in the same epoch's regular rounds.
    """
    out: list[int] = []
    position = start
    while len(out) < count:
        pass_index, offset = divmod(position, num_prompts)
        generator = torch.Generator().manual_seed(seed + EXTRA_STREAM_SEED + pass_index)
        order = torch.randperm(num_prompts, generator=generator).tolist()
        taken = order[offset : offset + count - len(out)]
        out.extend(taken)
        position += len(taken)
    return out


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Split every tensor of a batch along dim 0 into `parts` equal micro-batches."""
    chunks = {key: value.chunk(parts) for key, value in batch.items()}
    return [{key: chunks[key][i] for key in batch} for i in range(parts)]


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop prompt columns that are padding in every row and completion columns past every mask."""
    attention = batch["attention_mask"]
    prompt_width = attention.shape[1] - batch["completion_mask"].shape[1]
    first = int(attention[:, :prompt_width].any(dim=0).float().argmax())
    last = (
        int(batch["completion_mask"].any(dim=0).nonzero().max()) + 1 if batch["completion_mask"].any() else 1
    )
    out = dict(batch)
    out["input_ids"] = batch["input_ids"][:, first : prompt_width + last]
    out["attention_mask"] = attention[:, first : prompt_width + last]
    for key in ("completion_mask", "sampler_logps"):  # the per-completion-token columns
        if key in batch:
            out[key] = batch[key][:, :last]
    return out
