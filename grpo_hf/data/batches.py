"""The prompt dataset on its way into a generation round: checks, group sampling, micro-batches.

- `check_prompt_dataset`: a dataset the trainer cannot use fails before any model work, naming
  the column to fix (a dict of eval datasets entry by entry; a stream as far as it can be checked
  without reading it, its rows then by `PromptChecker` as they come, see `streaming`).
- `check_batching`: dataloader settings a GRPO batch cannot go through, before any model work
  (`check_datasets` runs both).
- `GroupSampler`: each prompt repeated G times, in the same order on every process;
  `data_order_seed`: the seed of the data order.
- `ExtraPrompts` / `extra_prompt_indices`: the prompts of dynamic sampling's extra rounds, a
  second shuffled stream.
- `keep_rows`: the collator (a batch is its list of rows; a module-level function, so that
  dataloader workers started by spawn or forkserver can unpickle it).
- `round_batch` / `split_batch` / `trim_padding` / `padded_to_multiple`: a generation batch's
  tensors cut into micro-batches with no all-padding columns (or, with `pad_to_multiple_of`,
  widths kept at multiples). `token_budget` cuts and deals its rows by tokens: `data.token_budget`.
"""

import logging
from collections.abc import Iterator

import datasets
import torch
import torch.nn.functional as F
from torch.utils.data import Sampler

from grpo_hf.data.rollout import Rollout

logger = logging.getLogger(__name__)


def keep_rows(rows: list[dict]) -> list[dict]:
    """The data collator: a batch stays a list of dataset rows (the trainer tokenizes after rendering)."""
    return rows


def is_stream(dataset: object) -> bool:
    """A `datasets.IterableDataset`: no length, read in order as it comes."""
    return isinstance(dataset, datasets.IterableDataset)


def check_prompt_dataset(dataset, name: str, needs_chat: bool = False, prompt_optional: bool = False) -> None:
    """Fail early, naming the column, on a dataset the trainer cannot use.

    `needs_chat`: tools are in use, so prompts must be chat messages (the chat template describes the
    tools and renders their results) and no column may be named 'environments' (the reward
    functions' keyword for the episodes' environments). `prompt_optional`: environments may supply
    the prompts (their `reset` returns them), so a dataset without a 'prompt' column is fine. A dict
    of datasets (`DatasetDict`, a dict of eval datasets) is checked entry by entry. A stream's
    columns are checked here when its features are known; its rows are checked as they are read
    (`PromptChecker`)."""
    if isinstance(dataset, dict):
        for key, entry in dataset.items():
            check_prompt_dataset(entry, f"{name}[{key!r}]", needs_chat, prompt_optional)
        return
    if isinstance(dataset, torch.utils.data.IterableDataset) and not is_stream(dataset):
        raise TypeError(
            f"{name} is a {type(dataset).__name__}; pass a datasets.Dataset, a datasets.IterableDataset (a "
            "stream, e.g. load_dataset(..., streaming=True)) or another indexable dataset of rows."
        )
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        check_columns(columns, name, needs_chat, prompt_optional)
    if is_stream(dataset):
        return
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty.")
    if columns is not None and "prompt" not in columns:
        return  # environments supply the prompts
    prompts = dataset["prompt"] if columns is not None else [row["prompt"] for row in dataset]
    check_prompt_kinds({prompt_kind(p) for p in prompts}, name, needs_chat)


def check_columns(columns: list[str], name: str, needs_chat: bool, prompt_optional: bool = False) -> None:
    """A 'prompt' column (unless environments supply the prompts), and no 'environments' column when
    tools or environments are in use."""
    if "prompt" not in columns and not prompt_optional:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}); rename the prompt column to 'prompt'."
        )
    if needs_chat and "environments" in columns:
        raise ValueError(
            f"{name} has a column named 'environments', the keyword that hands reward functions the episodes' "
            "environments; rename the column."
        )


def prompt_kind(prompt: object) -> str:
    """'text', 'chat' (a list of {'role', 'content'} messages), or the name of another type."""
    if isinstance(prompt, str):
        return "text"
    chat = isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    )
    return "chat" if chat else type(prompt).__name__


def check_prompt_kinds(kinds: set[str], name: str, needs_chat: bool) -> None:
    """The prompts' kinds (`prompt_kind`): all text or all chat, chat when tools are in use."""
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


class PromptChecker:
    """`check_prompt_dataset`'s rules for rows read one at a time (a stream's): the first row's
    columns, then every row's prompt against the kind of the rows before it. An error names the
    row by its place in the pass over the stream it was read in: `index` counts the rows read in
    pass `pass_index` (after a shuffle buffer, if any)."""

    def __init__(self, name: str, needs_chat: bool):
        self.name, self.needs_chat = name, needs_chat
        self.kind: str | None = None
        self.rows = 0  # rows checked, over every pass

    def __call__(self, row: dict, index: int, pass_index: int = 0) -> dict:
        of_pass = f" of pass {pass_index}" if pass_index else ""
        where = f"{self.name} (row {index}{of_pass} of the stream)"
        if self.rows == 0 or "prompt" not in row:
            check_columns(list(row), where, self.needs_chat)
        kind = prompt_kind(row["prompt"])
        check_prompt_kinds({kind} | ({self.kind} if self.kind else set()), where, self.needs_chat)
        self.kind = kind
        self.rows += 1
        return row


def check_datasets(args, train_dataset, eval_dataset, needs_chat: bool, environments=None) -> None:
    """Before any model work: the batching settings (`check_batching`) and both datasets
    (`check_prompt_dataset`; with an `environments.EnvironmentPool` the prompts are optional and it
    checks the rows' environments)."""
    check_batching(args, train_dataset)
    for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if dataset is not None:
            check_prompt_dataset(dataset, name, needs_chat, prompt_optional=environments is not None)
            if environments is not None:
                environments.check_dataset(dataset, name)


def check_batching(args, train_dataset) -> None:
    """Dataloader settings that a GRPO batch cannot go through, before any model work.

    A batch is a list of rows (prompt text or messages, and the other columns), which Accelerate
    cannot dispatch from the main process (`dispatch_batches`, which it would choose for a stream
    when unset): it is set False. `split_batches` would make per_device_train_batch_size a global
    size, and a generation round would no longer be whole groups on every process. A stream has no
    length, so `max_steps` sets the run's length; it is read in this process (`dataloader_num_workers`
    set to 0, as workers would each read their own part of it and interleave the groups).
    """
    accelerator_config = args.accelerator_config
    if accelerator_config.dispatch_batches:
        raise ValueError(
            "Iterable datasets require `dispatch_batches=False`, and so does every GRPO dataset: a batch is a "
            "list of rows (prompt text or messages and the other columns), which Accelerate cannot dispatch "
            "from the main process. Set accelerator_config={'dispatch_batches': False} or leave it unset."
        )
    accelerator_config.dispatch_batches = False
    if accelerator_config.split_batches:
        raise ValueError(
            "accelerator_config split_batches=True is not supported: GRPO batch sizes count each process's "
            "completions and a generation round spans every process. Leave split_batches unset and set "
            "per_device_train_batch_size to the global batch divided by the number of processes."
        )
    if is_stream(train_dataset):
        if args.max_steps <= 0:
            raise ValueError(
                "train_dataset is an IterableDataset (a stream, with no length): set max_steps to the number of "
                "optimizer steps to train."
            )
        if args.dataloader_num_workers:
            logger.warning(
                "Iterable datasets require dataloader_num_workers=0 to keep each prompt's group together; "
                "overriding dataloader_num_workers=%d.",
                args.dataloader_num_workers,
            )
            args.dataloader_num_workers = 0


def data_order_seed(args) -> int:
    """The seed of the data order (samplers, a stream's shuffle, dynamic sampling's extra prompts):
    `data_seed` when set, else `seed`, as `TrainingArguments` documents `data_seed`."""
    return args.data_seed if args.data_seed is not None else args.seed


class GroupSampler(Sampler[int]):
    """Prompt indices (shuffled unless `shuffle=False`), each repeated G times, each generation batch
    repeated `repeats` times; a trailing partial generation batch is dropped.

    Every process builds the same sequence from the same seed (reshuffled each epoch with seed +
    epoch); Accelerate hands each process its own contiguous slice of every generation batch.
    """

    def __init__(
        self,
        num_prompts: int,
        num_generations: int,
        prompts_per_batch: int,
        repeats: int,
        seed: int,
        shuffle: bool = True,
    ):
        self.num_prompts, self.num_generations = num_prompts, num_generations
        self.prompts_per_batch, self.repeats, self.seed = prompts_per_batch, repeats, seed
        self.shuffle = shuffle
        self.epoch = 0

    @classmethod
    def for_training(cls, args, num_prompts: int, repeats: int) -> "GroupSampler":
        """A `GRPOConfig`'s training order: generation batches of its size, each `repeats` times."""
        prompts_per_batch = args.generation_batch_size // args.num_generations
        seed = data_order_seed(args)
        return cls(num_prompts, args.num_generations, prompts_per_batch, repeats, seed, args.shuffle_dataset)

    @classmethod
    def for_evaluation(cls, args, num_prompts: int) -> "GroupSampler":
        """Evaluation: every prompt num_generations_eval times, one group at a time."""
        return cls(num_prompts, args.num_generations_eval, 1, 1, data_order_seed(args))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_prompts, generator=generator).tolist()
        else:
            order = list(range(self.num_prompts))
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


class ExtraPrompts:
    """The rows of dynamic sampling's extra prompt stream of a map-style dataset (`extra_prompt_indices`)."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def take(self, start: int, count: int) -> list[dict]:
        """The rows at positions `start .. start + count - 1` of the stream (each distinct one read once)."""
        indices = extra_prompt_indices(len(self.dataset), self.seed, start, count)
        fetched = {i: self.dataset[i] for i in dict.fromkeys(indices)}
        return [fetched[i] for i in indices]


def round_batch(result: Rollout, advantages: torch.Tensor, mask_truncated: bool) -> dict[str, torch.Tensor]:
    """A generation batch's tensors for the loss (before `split_batch`). Its loss mask is the
    completion mask without tool results (context, not the policy's choice) and, with
    `mask_truncated` (mask_truncated_completions), without the truncated completions."""
    loss_mask = result.completion_mask  # (B, C)
    if mask_truncated:
        loss_mask = loss_mask * (~result.truncated).unsqueeze(1)
    if result.tool_mask is not None:
        loss_mask = loss_mask * (1 - result.tool_mask)
    batch = {
        "input_ids": result.input_ids,  # (B, P + C)
        "attention_mask": result.attention_mask,  # (B, P + C)
        "completion_mask": loss_mask,  # (B, C)
        "advantages": advantages,  # (B,)
    }
    if result.sampler_logps is not None:
        batch["sampler_logps"] = result.sampler_logps  # (B, C)
    return batch


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Split every tensor of a batch along dim 0 into `parts` equal micro-batches."""
    chunks = {key: value.chunk(parts) for key, value in batch.items()}
    return [{key: chunks[key][i] for key in batch} for i in range(parts)]


def _round_up(width: int, multiple: int | None) -> int:
    return width if multiple is None else -(-width // multiple) * multiple


def trim_padding(batch: dict[str, torch.Tensor], multiple: int | None = None) -> dict[str, torch.Tensor]:
    """Drop prompt columns that are padding in every row and completion columns past every mask.

    With `multiple` (`pad_to_multiple_of`; the batch's widths are multiples of it) the kept prompt
    and completion widths are rounded up to multiples of it instead.
    """
    attention = batch["attention_mask"]
    completion_width = batch["completion_mask"].shape[1]
    prompt_width = attention.shape[1] - completion_width
    first = int(attention[:, :prompt_width].any(dim=0).float().argmax())
    last = (
        int(batch["completion_mask"].any(dim=0).nonzero().max()) + 1 if batch["completion_mask"].any() else 1
    )
    first = max(0, prompt_width - _round_up(prompt_width - first, multiple))
    last = min(completion_width, _round_up(last, multiple))
    out = dict(batch)
    out["input_ids"] = batch["input_ids"][:, first : prompt_width + last]
    out["attention_mask"] = attention[:, first : prompt_width + last]
    for key in ("completion_mask", "sampler_logps", "old_logps", "ref_logps"):  # per completion token
        if key in batch:
            out[key] = batch[key][:, :last]
    return out


def padded_to_multiple(result: Rollout, multiple: int | None, pad_token_id: int) -> Rollout:
    """`result` with its prompt columns left-padded and its completion columns right-padded to
    multiples of `multiple` (`pad_to_multiple_of`; None: as it is). Padding is out of every mask."""
    if multiple is None:
        return result
    left = -result.prompt_ids.shape[1] % multiple
    right = -result.completion_ids.shape[1] % multiple

    def completion_padded(values: torch.Tensor | None, fill: float) -> torch.Tensor | None:
        return None if values is None else F.pad(values, (0, right), value=fill)  # (B, C')

    return Rollout(
        prompt_ids=F.pad(result.prompt_ids, (left, 0), value=pad_token_id),  # (B, P')
        prompt_mask=F.pad(result.prompt_mask, (left, 0), value=0),  # (B, P')
        completion_ids=completion_padded(result.completion_ids, pad_token_id),
        completion_mask=completion_padded(result.completion_mask, 0),
        truncated=result.truncated,
        sampler_logps=completion_padded(result.sampler_logps, 0.0),
        tool_mask=completion_padded(result.tool_mask, 0),
    )
