"""Async GRPO: the next generation rounds are sampled on a vLLM server while the trainer trains
(TRL's `AsyncGRPOTrainer`; verl's one-step-off-policy pipeline), on with `max_staleness >= 1`.

A round flows as in synchronous training, each process with its own share of the rows:

- rows: the trainer's dataloader is read ahead (`AsyncRounds.ahead`, inside the Trainer's
  `get_batch_samples`, on the training thread), so the data order stays the sampler's, each prompt
  once. A round's rows are read as soon as the round is trained in the current sync interval or the
  next one (and `queue_maxsize` has room), and go to the generation thread tagged with the policy
  version the server holds then;
- the generation thread (one per process) samples and scores the rounds in order
  (`GRPOTrainer._sample_and_score` through `ServerGenerator.generate_alone`: HTTP from this
  process alone, for plain completions, every turn of tool episodes and a rollout_func's calls;
  reward functions, async ones and reward models in this process, as in synchronous training).
  It issues no collective: every torch.distributed call (tool metrics, dynamic sampling's extra
  rounds) stays on the training thread. Its reward functions' `trainer_state` is a copy of the
  Trainer's state taken when the round's policy version was made (at the start of training or the
  sync step; its lists, log_history included, are shared): global_step counts the optimizer steps
  in the weights that sampled the round, as in synchronous training, and stays put while they run
  (the live state moves on with the training thread);
- the training thread takes each round when it starts it (`take`) and prepares it as always
  (advantages over every process, micro-batches, old log-probs). Every weight_sync_steps optimizer
  steps (`on_step_end`) it waits for the rounds the thread was given; the weights then are the next
  policy version, sent to the server (`ServerGenerator.load_policy`) when a round will be read
  before the next sync, or later when something samples from them (evaluation, extra rounds), and
  not at all otherwise: with rounds spanning several steps (steps_per_generation >
  gradient_accumulation_steps) no request would use most versions. perf/rollout_wait_s is both
  waits (the one at a sync counted with the next take); perf/weight_sync_s times each sending.

Every round comes from one policy version, fixed when its rows are read, and is trained within
the next sync interval: its staleness (the trainer's version when it takes the round minus the
round's) is 0 or 1. Going further ahead would not overlap more (the server holds one set of
weights, so the rounds of version v are generated between syncs v and v + 1 whatever their
distance), only add staleness. The schedule depends on the step count, not on timing: with a
server that samples deterministically per request seed, runs are reproducible, and a checkpoint
(taken once the thread has finished every round it was given: `save`) holds the rounds not trained
on yet with their versions and the version counter, so a resumed run continues as if never
stopped (when checkpoints fall on sync steps). A round older than max_staleness (a queue restored
under other settings) is dropped, counted (sample/dropped_stale_total) and sampled again, so no
prompt is lost. TRL's worker instead streams with whatever weights are current and drops what
is too old: timing decides the versions, and dropped prompts are lost.

The thread and its faults (an error reaches the training thread at its next wait, on every
process at once; `stop` aborts the requests in flight and joins it): `episodes.round_queue`.
"""

import contextlib
import copy
import itertools
import logging
import os
import pickle
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import TrainerCallback, TrainerState
from transformers.trainer_utils import has_length

from grpo_hf.data.rollout import ScoredRound
from grpo_hf.engine.vllm.client import VLLMClient
from grpo_hf.episodes.round_queue import Round, RoundQueue
from grpo_hf.rewards.scoring import RewardModel

logger = logging.getLogger(__name__)

ASYNC_FILE = "grpo_async_{}.pt"  # per process: the version counter and the rounds not trained on yet


@dataclass(frozen=True)
class EpochLayout:
    """Where the Trainer's loop trains each micro-batch: every epoch's `micro_batches` (its dataloader's
    length; a stream: max_steps x gradient_accumulation_steps) in optimizer steps of `accumulation`,
    the epoch's last step shorter where they do not divide (transformers' `Trainer._run_epoch`, which
    also resumes a run at `first_of(global_step)`). Micro-batches are counted over every epoch."""

    micro_batches: int
    accumulation: int

    @property
    def steps(self) -> int:
        """Optimizer steps per epoch."""
        return -(-self.micro_batches // self.accumulation)

    def step_of(self, index: int) -> int:
        """The optimizer steps done when micro-batch `index` is trained (the step it is trained in)."""
        epoch, within = divmod(index, self.micro_batches)
        return epoch * self.steps + within // self.accumulation

    def first_of(self, step: int) -> int:
        """The first micro-batch of optimizer step `step` (counted from 0)."""
        epoch, within = divmod(step, self.steps)
        return epoch * self.micro_batches + within * self.accumulation


@dataclass(frozen=True)
class AsyncSettings:
    """What the schedule needs from the run's settings."""

    max_staleness: int
    weight_sync_steps: int
    queue_rounds: int  # rounds generated ahead at most (queue_maxsize // generation_batch_size)
    round_length: int  # micro-steps fed by one round
    gradient_accumulation_steps: int
    generation_batch_size: int  # completions of a round over every process


class AsyncRounds(TrainerCallback):
    """Which rounds the generation thread makes, from which version, and the weight syncs (see the
    module docstring)."""

    def __init__(
        self,
        settings: AsyncSettings,
        queue: RoundQueue,
        sync_weights: Callable[[int], bool],
        new_client: Callable[[], VLLMClient],
        record: Callable[[dict[str, float]], None],
    ):
        """`sync_weights(version)` sends the policy's weights to the server as `version` (collective)
        unless it holds that version already, and says whether it sent them; `new_client()` a client
        for the thread's requests; `record` takes metric values."""
        self.settings, self.queue, self.record = settings, queue, record
        self._sync_weights, self._new_client = sync_weights, new_client
        self.version = 0  # the current policy version: sync steps passed (0: the initial weights)
        self._read: deque = deque()  # micro-batches read ahead, not handed to the Trainer yet
        self._next_read = 0  # index of the next micro-batch to read (counted over every epoch)
        self._next_take = 0  # index of the next round the trainer takes
        self._drained_s = 0.0  # seconds waited for the thread's rounds at syncs since the last take
        self._state = None  # the Trainer's state (global_step, max_steps), from on_train_begin
        self._layout: EpochLayout | None = None  # from on_train_begin
        self._version_state: TrainerState | None = None  # the Trainer's state when this version was made
        self._resumed_at: int | None = None  # micro-batches a checkpoint being resumed had trained

    # ---- Rows: the dataloader read ahead (training thread) --------------------------------------

    def ahead(self, batches: Iterator) -> Iterator:
        """The Trainer's micro-batches from `batches`, read ahead: each round's rows go to the thread
        as soon as the schedule allows (`_may_read`)."""
        while True:
            self._read_ahead(batches)
            if not self._read:
                return
            yield self._read.popleft()

    def _read_ahead(self, batches: Iterator) -> None:
        while not self._read or self._may_read(self._next_read):
            try:
                batch = next(batches)
            except StopIteration:
                return
            index, self._next_read = self._next_read, self._next_read + 1
            self._read.append(batch)
            if index % self.settings.round_length == 0:
                self._give(index // self.settings.round_length, batch)

    def _may_read(self, index: int) -> bool:
        """Whether micro-batch `index` may be read before the Trainer needs it: within max_steps, and
        a round's first one only when the round is in reach (`_in_reach`) and fewer than queue_rounds
        rounds wait."""
        if index % self.settings.round_length:
            return self._layout.step_of(index) < self._state.max_steps  # the rest of a round already read
        return self._in_reach(index) and len(self.queue.rounds) < self.settings.queue_rounds

    def _in_reach(self, start: int) -> bool:
        """Whether the round whose first micro-batch is `start` is trained within max_steps and before
        the second sync from now (so its rows are read before the next sync)."""
        taken_at, steps = self._layout.step_of(start), self._state.global_step  # optimizer steps done
        sync_steps = self.settings.weight_sync_steps
        return taken_at < self._state.max_steps and taken_at // sync_steps - steps // sync_steps <= 1

    def _give(self, index: int, rows: list[dict]) -> None:
        """Round `index` to the thread, from the current version (sent first if the server lacks it: the
        thread is idle then, see `on_step_end`); a round restored from a checkpoint only gets its rows
        back."""
        restored = self.queue.rounds.get(index)
        if restored is not None:
            restored.rows = rows
        else:
            self._send()
            self.queue.give(index, rows, self.version, self._version_state)

    # ---- Rounds in, weights out (training thread) ----------------------------------------------

    def take(self) -> ScoredRound:
        """The next round, sampled and scored (this process's rows), once the thread has made it; a round
        older than max_staleness is sampled again from the current weights. Every process calls it,
        at the start of each round."""
        start = time.perf_counter() - self._drained_s  # waiting at the last sync counts too
        self._drained_s = 0.0
        taken = self.queue.take(self._next_take)
        self._next_take += 1
        staleness = self.version - taken.version
        if staleness > self.settings.max_staleness:
            taken = self._again(taken, staleness)
            staleness = 0
        scored = taken.scored
        self.record(
            {
                "perf/rollout_wait_s": time.perf_counter() - start,
                "sample/staleness_mean": float(staleness),
                "sample/staleness_max": float(staleness),
                "sample/rollout_queue_size": float(
                    self.queue.waiting() * self.queue.accelerator.num_processes
                ),
                "rollout/generated_tok_s": float(scored.result.completion_mask.sum())
                / max(scored.seconds, 1e-9),
            }
        )
        return scored

    def _again(self, stale: Round, staleness: int) -> Round:
        """`stale`, dropped (sample/dropped_stale_total counts its completions on every process) and
        sampled again from the current weights, first in the thread's line."""
        self.record({"sample/dropped_stale_total": float(self.settings.generation_batch_size)})
        logger.warning(
            "Round %d was sampled from policy version %d, %d versions before this one (max_staleness=%d): "
            "dropped, and its prompts sampled again.",
            stale.index, stale.version, staleness, self.settings.max_staleness,
        )  # fmt: skip
        self._send()
        self.queue.give(stale.index, stale.rows, self.version, self._version_state, first=True)
        return self.queue.take(stale.index)

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        """Send the policy (the initial weights, or a checkpoint's) as the current version, then start
        the thread; reading ahead starts at the Trainer's micro-batch (a resumed run's: the one after
        those its checkpoint trained)."""
        accumulation = self.settings.gradient_accumulation_steps
        batches = len(train_dataloader) if has_length(train_dataloader) else state.max_steps * accumulation
        self._state, self._layout = state, EpochLayout(batches, accumulation)
        self._next_read = self._layout.first_of(state.global_step)
        resumed_at, self._resumed_at = self._resumed_at, None
        if resumed_at not in (None, self._next_read):
            raise ValueError(
                f"The checkpoint resumed had trained {resumed_at} micro-batches of async GRPO rounds, but the Trainer "
                f"resumes after {self._next_read} of this run's dataloader: resume with the train_dataset, batch "
                "sizes, gradient_accumulation_steps, steps_per_generation and number of processes it was saved with."
            )
        # A round begun before the checkpoint is in it (its rest of micro-batches): the next one is taken.
        self._next_take = -(-self._next_read // self.settings.round_length)
        self._version_state = copy.copy(state)
        self._sync_weights(self.version)
        self.queue.start(self._new_client())

    def on_step_end(self, args, state, control, **kwargs):
        """Every weight_sync_steps steps: the next policy version, sent to the server when a round will
        be read before the next sync (one version in steps_per_generation / gradient_accumulation_steps
        is, when a round spans several steps; the rest would be whole-model copies no request uses).
        Before it, and before a checkpoint or an evaluation, the thread finishes the rounds it was
        given, so while a version is not sent the thread is idle: whatever samples from it next (a
        round given, a stale one again, evaluation or extra rounds through the generator) sends it
        (with weight_sync_steps > 1, the weights of that step; rounds read ahead get the sync step's)."""
        syncing = state.global_step % self.settings.weight_sync_steps == 0
        if syncing or control.should_save or control.should_evaluate:
            start = time.perf_counter()
            self.queue.drain()
            self._drained_s += time.perf_counter() - start
        if syncing:
            self.version, self._version_state = self.version + 1, copy.copy(state)
            next_round = -(-self._next_read // self.settings.round_length) * self.settings.round_length
            if self._in_reach(next_round):
                self._send()

    def _send(self) -> None:
        """The current version to the server, unless it holds it (perf/weight_sync_s times a sending)."""
        start = time.perf_counter()
        if self._sync_weights(self.version):
            self.record({"perf/weight_sync_s": time.perf_counter() - start})

    def stop(self) -> None:
        """Stop the thread; forget what was read ahead (a checkpoint holds the rounds made)."""
        self.queue.stop()
        self._read.clear()

    # ---- Checkpoints -----------------------------------------------------------------------------

    def save(self, folder: str) -> None:
        """Write this process's rounds not trained on yet and the version counter into a checkpoint
        folder (temp file, read back as `load` reads it, then renamed), once the thread has made every
        round it was given. A file that cannot be read back fails here, on every process, before the
        checkpoint is marked complete (resume_from_checkpoint=True then takes the previous one)."""
        self.queue.drain()
        path = os.path.join(folder, ASYNC_FILE.format(self.queue.accelerator.process_index))
        trained = self._next_read - len(self._read)  # micro-batches handed to the Trainer: all trained
        torch.save({"version": self.version, "rounds": self.queue.state(), "trained": trained}, path + ".tmp")
        error = None
        try:
            torch.load(path + ".tmp", weights_only=True)
        except pickle.UnpicklingError as unreadable:
            reason = str(unreadable).partition("WeightsUnpickler error: ")[2].partition(". ")[0]
            error = ValueError(
                f"{path}.tmp (async GRPO's rounds not trained on yet: their completions and what reward functions "
                f"logged) cannot be read back by torch.load(weights_only=True), so the checkpoint could not be "
                f"resumed: {reason or unreadable}. It is left incomplete."
            )
        self.queue.agree(error)
        os.replace(path + ".tmp", path)

    def load(self, folder: str) -> None:
        """Restore what `save` wrote (the micro-batches trained are checked against the Trainer's
        position at `on_train_begin`); a checkpoint of synchronous training has none: version 0."""
        accelerator = self.queue.accelerator
        path = os.path.join(folder, ASYNC_FILE.format(accelerator.process_index))
        state = {"version": 0, "rounds": []}
        if os.path.isfile(path):
            state = torch.load(path, map_location=accelerator.device, weights_only=True)
        self.version, self._resumed_at = state["version"], state.get("trained")
        self.queue.load_state(state["rounds"])


@contextlib.contextmanager
def stopping(rounds: AsyncRounds | None) -> Iterator[None]:
    """Stop the generation thread however training ends."""
    try:
        yield
    finally:
        if rounds is not None:
            rounds.stop()


def async_rounds(trainer) -> AsyncRounds | None:
    """The trainer's async rounds, registered as its callback; None with max_staleness=0. Refuses at
    construction what the generation thread cannot run: a collective reward model."""
    args = trainer.args
    if args.max_staleness == 0:
        return None
    sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
    if sharded and any(isinstance(f, RewardModel) for f in trainer.reward_funcs):
        raise ValueError(
            f"Async GRPO (max_staleness={args.max_staleness}) does not run a reward model under FSDP / DeepSpeed: "
            "its forward is collective, and the generation thread scores without collectives. Set "
            "max_staleness=0 (synchronous training)."
        )
    generator, sampling = trainer.generator, trainer.sampling
    max_requests = 32 if args.max_inflight_tasks == -1 else args.max_inflight_tasks

    def produce(made: Round, client: VLLMClient) -> ScoredRound:
        calls = itertools.count()  # the round's calls (tool turns, a rollout_func's): each its own seeds

        def generate(prompt_ids, prompt_mask, max_new_tokens=None):
            used = sampling if max_new_tokens is None else sampling.with_max_new_tokens(max_new_tokens)
            call = f"round {made.index}.{next(calls)}"
            return generator.generate_alone(
                prompt_ids, prompt_mask, used, made.version, call, client, max_requests
            )

        return trainer._sample_and_score(made.rows, generate, made.trainer_state)

    settings = AsyncSettings(
        max_staleness=args.max_staleness,
        weight_sync_steps=args.weight_sync_steps,
        queue_rounds=args.queue_maxsize // args.generation_batch_size,
        round_length=trainer.round_length,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        generation_batch_size=args.generation_batch_size,
    )
    queue = RoundQueue(trainer.accelerator, produce, args.heartbeat_stale_after_s)
    client = generator.client
    new_client = lambda: VLLMClient(client.base_url, client.timeout, on_answer=queue.tick)  # noqa: E731
    rounds = AsyncRounds(settings, queue, generator.sync, new_client, trainer.record)
    trainer.add_callback(rounds)
    return rounds
