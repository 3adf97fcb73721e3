"""Iterable (streaming) prompt datasets: a `datasets.IterableDataset` has no length and no indices.

A sampler cannot be attached to a stream, so `GroupStream` hands the Trainer's dataloader the rows
themselves in the order `data.GroupSampler` gives a map-style dataset's indices: each prompt G
times, whole generation batches, each repeated for the micro-steps it feeds. What differs:

- Shuffling (`shuffle_dataset`) is the stream's own buffered shuffle (`IterableDataset.shuffle`,
  a buffer of 1000 rows), reshuffled for each pass over the stream, not a full permutation.
- Training reads the stream pass after pass without end (pass k after `set_epoch(k)`); the run's
  length is `max_steps`, and a generation batch may span the end of one pass and the start of
  the next, so no prompt is dropped. For the Trainer the whole run is one epoch.
- Every process reads the whole stream and Accelerate keeps its contiguous slice of each batch
  (`IterableDatasetShard`), as with the sampler: the same groups in the same order everywhere.
  (Accelerate would split a `datasets.IterableDataset` by its shards instead, and each process
  would form its groups from different prompts: `GroupStream` is a plain torch IterableDataset.)
- Rows are checked as they are read (`data.PromptChecker`): a bad row stops the run naming its
  position in the pass over the stream it was read in ("row 3 of pass 1": its fourth row read in
  the second pass).
- Resuming: the Trainer skips the micro-batches already trained by reading them again from the
  start of the stream (nothing is generated for them). The resumed run continues exactly where it
  stopped if the stream yields the same rows in the same order each time it is read (a seeded
  shuffle does); with `ignore_data_skip` it starts again at the stream's beginning.
- Dynamic sampling's extra prompts come from a second reader of the stream (`ExtraStreamPrompts`),
  shuffled with its own seed, its position saved in checkpoints like the map-style one's.
"""

import contextlib
import copy
import itertools
from collections.abc import Iterator

import datasets
import torch

from grpo_hf.data.batches import EXTRA_STREAM_SEED, ExtraPrompts, PromptChecker, data_order_seed, is_stream


def stream_rows(source: datasets.IterableDataset, checker: PromptChecker, endless: bool) -> Iterator[dict]:
    """The stream's rows, checked; with `endless`, pass after pass (`set_epoch(k)` before pass k)."""
    for pass_index in itertools.count() if endless else [0]:
        source.set_epoch(pass_index)
        read = 0
        for row in source:
            yield checker(row, read, pass_index)
            read += 1
        if read == 0 and pass_index == 0:
            raise ValueError(f"{checker.name} is empty.")
        if read == 0:  # a one-shot stream (e.g. over a generator object) would loop here forever
            raise ValueError(
                f"{checker.name} yielded no rows when read again for pass {pass_index}; training reads a stream "
                "pass after pass until max_steps, so it must be readable more than once."
            )


class GroupStream(torch.utils.data.IterableDataset):
    """A stream's rows in group order: `prompts_per_batch` prompts at a time, each `num_generations`
    times (fresh copies, as indexing a map-style dataset makes), the batch `repeats` times.

    `endless` (training): pass after pass over the stream. Otherwise (evaluation) one pass, its last
    batch possibly smaller.
    """

    def __init__(
        self,
        source: datasets.IterableDataset,
        checker: PromptChecker,
        num_generations: int,
        prompts_per_batch: int = 1,
        repeats: int = 1,
        endless: bool = False,
    ):
        self.source, self.checker = source, checker
        self.num_generations, self.prompts_per_batch, self.repeats = (
            num_generations,
            prompts_per_batch,
            repeats,
        )
        self.endless = endless

    def __iter__(self) -> Iterator[dict]:
        rows = stream_rows(self.source, self.checker, self.endless)
        while prompts := list(itertools.islice(rows, self.prompts_per_batch)):
            for _ in range(self.repeats):
                for row in prompts:
                    for _ in range(self.num_generations):
                        yield copy.deepcopy(row)


def group_stream(
    dataset: datasets.IterableDataset, args, name: str, needs_chat: bool, training: bool
) -> GroupStream:
    """The `GroupStream` of a train or eval dataset under `args` (a `GRPOConfig`)."""
    checker = PromptChecker(name, needs_chat)
    if not training:
        return GroupStream(dataset, checker, args.num_generations_eval)
    source = dataset.shuffle(seed=data_order_seed(args)) if args.shuffle_dataset else dataset
    return GroupStream(
        source,
        checker,
        args.num_generations,
        prompts_per_batch=args.generation_batch_size // args.num_generations,
        repeats=args.steps_per_generation * args.num_iterations,
        endless=True,
    )


class ExtraStreamPrompts:
    """Dynamic sampling's extra prompt stream for a `datasets.IterableDataset`: a second reader of
    the stream, pass after pass, shuffled with seed + 2**31 (as the map-style extra stream).

    Every process reads the same rows in the same order. Early in a run its prompts come from the
    same region of the stream as the regular rounds' (a shuffle buffer only mixes nearby rows), so
    a prompt can come up in both, as with a map-style dataset.
    """

    def __init__(self, dataset: datasets.IterableDataset, seed: int, checker: PromptChecker):
        self.source = dataset.shuffle(seed=seed + EXTRA_STREAM_SEED)
        self.checker = checker
        self._rows: Iterator[dict] | None = None
        self._position = 0

    def take(self, start: int, count: int) -> list[dict]:
        """The rows at positions `start .. start + count - 1` (a resumed run starts at its saved position)."""
        if self._rows is None or self._position != start:
            self._rows = stream_rows(self.source, self.checker, endless=True)
            next(itertools.islice(self._rows, start, start), None)  # skip `start` rows
            self._position = start
        taken = list(itertools.islice(self._rows, count))
        self._position += len(taken)
        return taken


def extra_prompt_source(dataset, seed: int, needs_chat: bool) -> ExtraPrompts | ExtraStreamPrompts | None:
    """Where dynamic sampling's extra prompts come from: `take(start, count)` rows."""
    if dataset is None:
        return None
    if is_stream(dataset):
        return ExtraStreamPrompts(dataset, seed, PromptChecker("train_dataset", needs_chat))
    return ExtraPrompts(dataset, seed)


@contextlib.contextmanager
def read_in_process(args) -> Iterator[None]:
    """Within: dataloaders read in this process (no workers); the settings are restored on exit."""
    names = ("dataloader_num_workers", "dataloader_persistent_workers", "dataloader_prefetch_factor")
    saved = {name: getattr(args, name) for name in names}
    args.dataloader_num_workers, args.dataloader_persistent_workers, args.dataloader_prefetch_factor = (
        0,
        False,
        None,
    )
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(args, name, value)
