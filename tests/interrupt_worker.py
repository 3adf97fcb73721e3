"""One process of a 2-process run that a SIGTERM reaches on process 1 only; launched by `accelerate launch`.

    python tests/interrupt_worker.py <output folder>

Process 1 sends itself SIGTERM as optimizer step 3 begins. Each process writes the optimizer steps
after which its trainer was told to stop to <output>/process-<i>.json, with its last global step;
the trainer's checkpoints go to <output>/train. Used by tests/test_robustness.py.
"""

import json
import os
import signal
import sys
from pathlib import Path

from dist_worker import exit_worker
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, length_reward, make_config
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer


class SignalProcessOne(TrainerCallback):
    """SIGTERM to process 1 as step 3 begins; records the steps after which training was told to stop."""

    def __init__(self) -> None:
        self.stopped_after: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2 and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_training_stop:
            self.stopped_after.append(state.global_step)


def main(output: Path) -> None:
    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(
            output / "train",
            per_device_train_batch_size=4,
            num_generations=4,
            max_steps=8,
            save_strategy="steps",
            save_steps=100,  # only the interrupt saves
        ),
        train_dataset=chat_dataset(8),
        processing_class=tiny_tokenizer(),
    )
    recorder = SignalProcessOne()
    trainer.add_callback(recorder)  # after SaveOnInterrupt: it sees the decision of this step
    trainer.train()
    result = {"stopped_after": recorder.stopped_after, "global_step": trainer.state.global_step}
    (output / f"process-{trainer.accelerator.process_index}.json").write_text(json.dumps(result))
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
