"""Checkpoints that a crash cannot corrupt, and a clean stop on SIGTERM / Ctrl-C.

The Trainer writes a checkpoint folder file by file. GRPO's own state (adaptive beta, KL of the
round so far, position in dynamic sampling's extra prompt stream, the adaptive entropy
coefficient and the entropy it last saw) is written last, atomically,
and doubles as the "complete" marker: resuming with `resume_from_checkpoint=True` takes the newest
folder that has it, so a crash while saving leaves the previous checkpoint in charge. Old checkpoints are rotated only after the new one is complete.
A checkpoint saved inside a generation round (num_iterations > 1, or several optimizer steps per
round) also holds each process's remaining micro-batches of that round, so resuming continues on
the same completions instead of sampling new ones.
`NonFiniteGuard` skips optimizer steps with non-finite gradients, so no NaN reaches the weights.
"""

import contextlib
import json
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper
from transformers import TrainerCallback

STATE_FILE = "grpo_state.json"
ROUND_FILE = "grpo_round_{}.pt"  # per process: the rest of a generation round saved mid-round
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# resume_from_checkpoint as the command line gives it (a string): these words are a bool, not a folder
_RESUME_WORDS = {"true": True, "1": True, "false": False, "0": False, "": False}


def write_state(folder: str, state: dict) -> None:
    """Write the GRPO state into a checkpoint folder atomically (temp file, then rename)."""
    path = os.path.join(folder, STATE_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def read_state(folder: str) -> dict:
    """The GRPO state of a complete checkpoint; a clear error for an incomplete one."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"resume_from_checkpoint={folder!r} is incomplete (no {STATE_FILE}: the run stopped while saving, "
            "or it was not written by GRPOTrainer). Pass an earlier checkpoint, or resume_from_checkpoint=True "
            "to take the newest complete one."
        )
    with open(path) as f:
        return json.load(f)


def write_round(folder: str, process_index: int, micro_batches: list[dict]) -> None:
    """Save this process's micro-batches of the current generation round (temp file, then rename)."""
    path = os.path.join(folder, ROUND_FILE.format(process_index))
    torch.save(micro_batches, path + ".tmp")
    os.replace(path + ".tmp", path)


def read_round(folder: str, process_index: int, device: torch.device) -> list[dict]:
    """The micro-batches of the generation round a checkpoint was saved in the middle of."""
    path = os.path.join(folder, ROUND_FILE.format(process_index))
    if not os.path.isfile(path):
        raise ValueError(
            f"resume_from_checkpoint={folder!r} was saved inside a generation round but has no {os.path.basename(path)}; "
            "resume from a checkpoint saved at the end of a round, or with the same steps_per_generation, "
            "num_iterations and number of processes."
        )
    return torch.load(path, map_location=device, weights_only=True)


def complete_checkpoint(
    folder: str, accelerator: Accelerator, state: dict | None, round_rest: list[dict] | None
) -> None:
    """Complete a checkpoint folder the Trainer has written: this process's rest of the generation
    round when it was saved inside one (`round_rest`), then, once every process's files are in, the
    GRPO state, the completion marker (`state`: None on the processes that do not save)."""
    if round_rest is not None:
        write_round(folder, accelerator.process_index, round_rest)
    accelerator.wait_for_everyone()  # every process's files are in before the marker
    if state is not None:
        write_state(folder, state)


def read_checkpoint(
    folder: str, accelerator: Accelerator, gradient_accumulation_steps: int, round_length: int
) -> tuple[dict, int, list[dict]]:
    """A checkpoint's GRPO state, the micro-step it was saved after, and this process's rest of the
    generation round it was saved inside ([] when it was saved at the end of a round)."""
    state = read_state(folder)
    with open(os.path.join(folder, "trainer_state.json")) as f:
        micro_step = json.load(f)["global_step"] * gradient_accumulation_steps
    inside_round = micro_step % round_length != 0
    rest = read_round(folder, accelerator.process_index, accelerator.device) if inside_round else []
    return state, micro_step, rest


def checkpoint_to_resume(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder to resume from, None for none. True, or the command line's "true" / "1"
    (`TrainingArguments.resume_from_checkpoint` is a string), is the newest complete checkpoint in
    output_dir; False, "false", "0" and "" are none (case-insensitive); any other string is a folder."""
    if isinstance(resume_from_checkpoint, str):
        resume_from_checkpoint = _RESUME_WORDS.get(resume_from_checkpoint.lower(), resume_from_checkpoint)
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint is not True:
        return resume_from_checkpoint
    folder = last_complete_checkpoint(output_dir)
    if folder is None:
        raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {output_dir}.")
    return folder


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest checkpoint-N folder of `output_dir` holding the completion marker."""
    if not os.path.isdir(output_dir):
        return None
    steps = [int(m.group(1)) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    for step in sorted(steps, reverse=True):
        folder = os.path.join(output_dir, f"checkpoint-{step}")
        if os.path.isfile(os.path.join(folder, STATE_FILE)):
            return folder
    return None


class SaveOnInterrupt(TrainerCallback):
    """On SIGTERM or SIGINT: finish the current optimizer step, save a checkpoint, stop cleanly.

    `catching_signals()` installs the handlers around `train()` and always restores the previous
    ones, even when training raises. A second signal falls back to the previous handler, so an
    impatient Ctrl-C still interrupts at once.

    With several processes, a signal may reach one of them only (`kill <pid>`), or reach them on
    either side of a step's end. Saving is collective (every process writes its part, the gathers
    of FSDP / ZeRO), so at each step's end the processes agree (`received_anywhere`: an all-reduce
    of one number) and all stop after the same step, with one complete checkpoint.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    @contextlib.contextmanager
    def catching_signals(self) -> Iterator[None]:
        self.received = None
        if threading.current_thread() is not threading.main_thread():  # signals are main-thread only
            yield
            return
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            signal.signal(signum, self._previous[signum])
            signal.raise_signal(signum)
        self.received = signum

    def received_anywhere(self) -> bool:
        """Whether any process has received a signal (every process must call it: a collective)."""
        received = self.received is not None
        if self.accelerator.num_processes == 1:
            return received
        flag = torch.tensor([float(received)], device=self.accelerator.device)  # (1,)
        return self.accelerator.reduce(flag, "sum").item() > 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.received_anywhere():
            control.should_save = True
            control.should_training_stop = True


class NonFiniteGuard(TrainerCallback):
    """Skips an optimizer step whose gradients are not finite; stops after too many in a row.

    A skipped step leaves weights and optimizer state untouched, so no NaN ever reaches a checkpoint.
    `record` receives a metric per skipped step ("nonfinite_steps_skipped"), which the trainer logs
    as the number of steps skipped in each logging interval.

    Under DeepSpeed the gradients never reach `p.grad` (ZeRO keeps them in its own partitioned
    buffers) and Accelerate runs `engine.step()` inside `accelerator.backward`, before this hook.
    There DeepSpeed's ZeRO optimizer (stages 1-3, checked with DeepSpeed 0.19.8) skips the step itself
    when the global gradient norm is not finite, for fp32 and bf16 as for fp16 (its `overflow` flag;
    it needs the norm, which DeepSpeed computes unless zero_optimization.compute_grad_norm is false).
    The guard reads that flag to count the skip and apply max_nonfinite_steps. With fp16 loss
    scaling, DeepSpeed's scale-calibration overflows count as skipped steps too.
    """

    def __init__(self, record: Callable[[dict[str, float]], None]) -> None:
        self.record = record
        self.in_a_row = 0

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if isinstance(optimizer, DeepSpeedOptimizerWrapper) and not optimizer.__has_overflow__:
            raise ValueError(
                "The non-finite gradient guard cannot see this DeepSpeed optimizer's gradients, and it has no "
                "overflow flag to report a skipped step: use a ZeRO optimizer (zero_stage 1, 2 or 3)."
            )

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if isinstance(optimizer, DeepSpeedOptimizerWrapper):  # DeepSpeed has stepped (or skipped) already
            if not optimizer.step_was_skipped:
                self.in_a_row = 0
                return
            params = []
        else:
            params = [p for p in model.parameters() if p.grad is not None]
            if all(torch.isfinite(p.grad).all() for p in params):
                self.in_a_row = 0
                return
        self.in_a_row += 1
        self.record({"nonfinite_steps_skipped": 1.0})
        for p in params:
            p.grad = None  # optimizers skip parameters without a gradient: the step is a no-op
        if self.in_a_row >= args.max_nonfinite_steps:
            raise RuntimeError(
                f"{self.in_a_row} optimizer steps in a row had non-finite gradients (skipped, no NaN was "
                "written). Lower learning_rate, set max_grad_norm, or check the reward functions; "
                "max_nonfinite_steps sets the limit."
            )


def grpo_state(trainer) -> dict:
    """What a checkpoint holds of a `GRPOTrainer` besides the Trainer's files (`write_state`): beta,
    the round's KL values, the extra prompt stream's position, the entropy coefficient's state."""
    return {
        **trainer.kl_control.state_dict(),  # beta, round_kl
        "extra_prompts": trainer.extra_rounds.position,
        "entropy": trainer.entropy_control.state_dict(),
    }


def load_grpo_state(trainer, state: dict) -> None:
    """Restore what `grpo_state` saved into `trainer`."""
    trainer.kl_control.load_state_dict(state)
    trainer.extra_rounds.position = state.get("extra_prompts", 0)  # absent in checkpoints older than it
    trainer.entropy_control.load_state_dict(state.get("entropy", trainer.entropy_control.state_dict()))
