"""The rounds of async GRPO, made by a generation thread (`episodes.async_rounds` decides which,
from which policy version, and when the trainer takes them).

`RoundQueue` holds this process's rounds given to the thread (or restored from a checkpoint) and
not taken yet; the thread makes them in order: `produce(round, client)` samples and scores one
(HTTP through the thread's own client, reward functions; no torch.distributed call, which stays on
the training thread). The training thread waits on it (`take`, `drain`):

- an error on the thread (no server, a request timing out, a reward function raising, any
  `BaseException`: asyncio.CancelledError from an async reward function) is raised by the training
  thread's next wait, as it was raised (a reward function's own exception), as synchronous
  training raises it;
- a thread from which nothing comes back (no answer from the server: `tick`, no round made) for
  `heartbeat_s` seconds while the trainer waits is an error;
- with several processes a wait goes in slices of `AGREE_EVERY_S`, each ending in a small
  all-reduce on the training thread (how many are ready, how many failed): no collective waits
  for a peer's whole round (its thread's multi-turn episodes may take far longer than this
  process's), so none outlasts `ddp_timeout` (gloo's timeout, NCCL's watchdog), and none goes on
  into a collective that a failed peer will never join (every process raises: `agree`);
- `stop` aborts the requests in flight (`VLLMClient.abort`) and joins the thread.
"""

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from transformers import TrainerState

from grpo_hf.data.rollout import ScoredRound
from grpo_hf.engine.vllm.client import VLLMClient

logger = logging.getLogger(__name__)

_ERRORS = {error.__name__: error for error in (ConnectionError, TimeoutError, ValueError, RuntimeError)}
AGREE_EVERY_S = 1.0  # with several processes, seconds a wait goes before they compare notes

# produce(round, client) -> the round sampled and scored (on the generation thread)
Produce = Callable[["Round", VLLMClient], ScoredRound]


@dataclass
class Round:
    """One generation round of this process: its rows, the policy version it is sampled from (and the
    trainer's state when that version was made, its reward functions' trainer_state), and what the
    thread made of it."""

    index: int
    rows: list[dict] | None  # None for a round restored from a checkpoint until its rows are read again
    version: int
    trainer_state: TrainerState | None = None  # None for a round restored from a checkpoint (made already)
    scored: ScoredRound | None = None

    @property
    def done(self) -> bool:
        return self.scored is not None


class RoundQueue:
    """This process's rounds not taken yet, and the thread that makes them (see the module docstring)."""

    def __init__(self, accelerator: Accelerator, produce: Produce, heartbeat_s: float):
        self.accelerator, self._produce, self.heartbeat_s = accelerator, produce, heartbeat_s
        self.rounds: dict[int, Round] = {}  # read under `changed` while the thread runs
        self._todo: deque[int] = deque()  # the thread's next rounds, in order
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: VLLMClient | None = None
        self._error: BaseException | None = None
        self._progress = 0.0  # when the server last answered the thread, or it made a round (time.monotonic)

    def tick(self) -> None:
        """The thread is alive: the server answered one of its requests (`VLLMClient.on_answer`)."""
        self._progress = time.monotonic()

    def give(
        self, index: int, rows: list[dict], version: int, trainer_state: TrainerState, first: bool = False
    ) -> Round:
        """Round `index` (replacing any of that index) to the thread, next in line with `first`."""
        made = Round(index, rows, version, trainer_state)
        with self.changed:
            self.rounds[index] = made
            self._todo.appendleft(index) if first else self._todo.append(index)
            self.changed.notify_all()
        return made

    def take(self, index: int) -> Round:
        """Round `index` out of the queue, once made (every process calls it)."""
        if index not in self.rounds:
            raise RuntimeError(f"Round {index} was never given to the generation thread (a bug in grpo-hf).")
        self.wait_until(lambda: self.rounds[index].done, f"round {index}")
        with self.changed:
            return self.rounds.pop(index)

    def waiting(self) -> int:
        """Completions made and not taken yet (this process's)."""
        with self.changed:
            return sum(len(r.scored.prompts) for r in self.rounds.values() if r.done)

    def drain(self) -> None:
        """Wait until the thread has made every round it was given, on every process."""
        self.wait_until(lambda: all(r.done for r in self.rounds.values()), "the rounds given to it")

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Wait until `ready()` on every process, or raise on every process once one's thread fails or
        sends nothing back for heartbeat_s (see the module docstring: in slices with several processes)."""
        since = time.monotonic()
        slice_s = AGREE_EVERY_S if self.accelerator.num_processes > 1 else math.inf
        while True:
            error, done = self._wait_here(ready, what, since, slice_s)
            failed, waiting = self._count([error is not None, not done])
            if failed:
                self.agree(error)  # raises on every process
            if not waiting:
                return

    def _wait_here(
        self, ready: Callable[[], bool], what: str, since: float, slice_s: float
    ) -> tuple[BaseException | None, bool]:
        """(this process's error or None, whether `ready()`) after waiting on the lock for `ready()`, the
        thread failing, nothing back from it for heartbeat_s since `since`, or `slice_s` seconds."""
        with self.changed:
            end = time.monotonic() + slice_s
            while not ready() and self._error is None:
                now = time.monotonic()
                quiet = now - max(since, self._progress)
                if quiet > self.heartbeat_s:
                    return TimeoutError(
                        f"Nothing came back from the async GRPO generation thread (no answer from the vLLM server, "
                        f"no round made) in {quiet:.0f} s while the trainer waited for {what} "
                        f"(heartbeat_stale_after_s={self.heartbeat_s:g}): is the server stuck, or a reward "
                        "function? Raise heartbeat_stale_after_s if a request or a reward takes this long."
                    ), False
                if now >= end:
                    return None, False
                self.changed.wait(timeout=min(1.0, self.heartbeat_s, end - now))
            return self._error, self._error is None

    def _count(self, flags: list[bool]) -> list[int]:
        """How many processes hold each of `flags` (every process calls it: an all-reduce of a few numbers)."""
        if self.accelerator.num_processes == 1:
            return [int(flag) for flag in flags]
        counts = torch.tensor([float(flag) for flag in flags], device=self.accelerator.device)
        return [int(count) for count in self.accelerator.reduce(counts, "sum").tolist()]

    def agree(self, error: BaseException | None) -> None:
        """Raise `error` (this process's) or a peer's: every process raises if any failed (every process
        calls it)."""
        failures = []
        if self.accelerator.num_processes > 1:
            said = None if error is None else (type(error).__name__, f"{type(error).__name__}: {error}")
            failures = [(p, s) for p, s in enumerate(gather_object([said])) if s is not None]
        if error is not None:
            raise error
        if failures:
            process, (kind, message) = failures[0]
            raise _ERRORS.get(kind, RuntimeError)(f"(from process {process}) {message}")

    # ---- The thread --------------------------------------------------------------------------------

    def start(self, client: VLLMClient) -> None:
        """Start the thread; its requests go through `client` (which `stop` aborts)."""
        self._stop.clear()
        self._error, self._progress, self._client = None, time.monotonic(), client
        self._thread = threading.Thread(target=self._run, name="grpo-async-rounds", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self._todo and not self._stop.is_set():
                    self.changed.wait()
                if self._stop.is_set():
                    return
                making = self.rounds[self._todo.popleft()]
            try:
                scored = self._produce(making, self._client)
            except BaseException as error:  # raised again by the training thread's next wait, whatever it is
                # (asyncio.CancelledError from an async reward function too): a thread that ends without
                # saying why would leave the trainer waiting for heartbeat_stale_after_s
                with self.changed:
                    self._error = None if self._stop.is_set() else error
                    self.changed.notify_all()
                return
            with self.changed:
                making.scored, self._progress = scored, time.monotonic()
                self.changed.notify_all()

    def stop(self) -> None:
        """Abort the requests in flight, join the thread, forget the rounds (a checkpoint holds them)."""
        if self._thread is not None:
            with self.changed:
                self._stop.set()
                self.changed.notify_all()
            self._client.abort()
            self._thread.join(timeout=30.0)
            if self._thread.is_alive():
                logger.warning(
                    "The async GRPO generation thread is still in a reward function 30 s after the run stopped; "
                    "it ends when that returns."
                )
            self._thread = None
        self.rounds.clear()
        self._todo.clear()

    # ---- Checkpoints -------------------------------------------------------------------------------

    def state(self) -> list[dict]:
        """The rounds not taken yet, made (after `drain`), as plain data."""
        with self.changed:
            rounds = sorted(self.rounds.values(), key=lambda r: r.index)
            return [{"index": r.index, "version": r.version, "scored": r.scored.state()} for r in rounds]

    def load_state(self, state: list[dict]) -> None:
        """Restore what `state` gave; each round gets its rows back when they are read again."""
        self.rounds = {
            r["index"]: Round(r["index"], None, r["version"], scored=ScoredRound.from_state(r["scored"]))
            for r in state
        }
