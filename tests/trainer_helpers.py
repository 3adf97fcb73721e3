"""Shared pieces for trainer tests: the suite's device, a prompt dataset, rewards, and a trainer with
fixed completions; a free port, the bench scripts as modules, and a best model chosen in advance."""

import importlib.util
import os
import socket
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.data.rollout import Rollout, completion_mask_after_eos

DEVICE_VARIABLE = "GRPO_HF_TEST_DEVICE"


def suite_device() -> str:
    """Where the trainer tests train: GRPO_HF_TEST_DEVICE, 'cpu' (the default, what CI runs) or 'cuda'.

    Some tests stay CPU-only in what they check (doubles that build CPU tensors, comparisons with
    tensors built on the CPU, CPU precision); on a GPU they fail for that reason, not the trainer's.
    """
    device = os.environ.get(DEVICE_VARIABLE, "").strip() or "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_VARIABLE}={device!r}: use 'cpu' (the default) or 'cuda'.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{DEVICE_VARIABLE}=cuda, but torch sees no CUDA GPU here.")
    return device


def exact_resume() -> dict:
    """The settings under which a resumed run is bit-identical to an uninterrupted one on the suite's
    device: deterministic kernels on CUDA (full_determinism); a CPU needs none."""
    return {"full_determinism": suite_device() == "cuda"}


def free_port() -> int:
    """A TCP port free right now, for a launch's main_process_port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_module(name: str):
    """bench/<name>.py, imported (bench/ is scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat_dataset(n: int = 8) -> Dataset:
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "answer": [str(2 * i) for i in range(n)]})


def length_reward(completions, **kwargs) -> list[float]:
    """Longer completions score higher: enough signal to move parameters. A chat completion's length is
    that of all its messages' contents (a multi-turn one's turns and tool results)."""
    return [(sum(len(m["content"]) for m in c) if isinstance(c, list) else len(c)) / 10 for c in completions]


def make_config(tmp_path, **overrides) -> GRPOConfig:
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=suite_device() == "cpu",
        seed=0,
        disable_tqdm=True,
        # The tests' settings where the defaults are TRL's (beta 0, logging every 10 steps, no prompt
        # limit, bf16 where native, checkpointing on): a reference, every step logged, float32 on every
        # CPU (the hand-computed values), no recomputation.
        beta=0.04,
        logging_steps=1,
        max_prompt_length=512,
        bf16=False,
        gradient_checkpointing=False,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


class FixedCompletionsTrainer(GRPOTrainer):
    """Completions are a pure function of the prompt row, so runs with different batch shapes agree.

    Row r of every group gets (r % G) + 2 tokens of a prompt-dependent pattern, then EOS. r counts
    rows of the whole generation batch, so a group split across processes gets the same completions
    as on one process (process p holds the p-th contiguous slice of the batch).
    """

    def generate_completions(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Rollout:
        width = self.args.max_completion_length
        eos = self.eos_token_ids[0]
        offset = self.accelerator.process_index * len(prompt_ids)  # global index of local row 0
        rows = []
        for i, ids in enumerate(prompt_ids):
            length = (offset + i) % self.args.num_generations + 2
            seed = int(ids[prompt_mask[i].bool()].sum())
            tokens = [(seed * (t + 3) + 7 * t) % 200 + 40 for t in range(length)] + [eos]
            rows.append((tokens + [self.processing_class.pad_token_id] * width)[:width])
        completion_ids = torch.tensor(rows, device=prompt_ids.device)  # (B, C)
        mask, truncated = completion_mask_after_eos(completion_ids, self.eos_token_ids)
        return Rollout(prompt_ids, prompt_mask, completion_ids, mask, truncated)


class BestAtStep(TrainerCallback):
    """Makes the evaluation at optimizer step `step` the best: it logs eval_chosen 1.0 there, 0.0 at
    every other step (with metric_for_best_model="chosen", greater_is_better=True)."""

    def __init__(self, step: int):
        self.step = step

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_chosen"] = float(state.global_step == self.step)


# With `BestAtStep(step)`, load_best_model_at_end loads checkpoint-`step`: an evaluation and a
# checkpoint after every optimizer step.
BEST_MODEL_SETTINGS = dict(
    eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
    load_best_model_at_end=True, metric_for_best_model="chosen", greater_is_better=True,
)  # fmt: skip
