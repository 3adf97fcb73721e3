"""Short GRPO trainings for tests/test_distributed.py, on one process or under `accelerate launch`.

    python tests/dist_worker.py OUTPUT_DIR SCENARIO [SCENARIO ...]
    accelerate launch --config_file recipes/accelerate/cpu_ddp2.yaml tests/dist_worker.py OUTPUT_DIR ...

A scenario fixes the *global* batch (completions per optimizer step over all processes); each
process takes `global_batch / num_processes` of it. Completions come from `FixedCompletionsTrainer`
(a function of the prompt and of the row's place in its group), so 1 and N processes train on the
same completions; the "sampled" scenarios use the real decode loop instead. Several scenarios run
in one launch, since the imports cost more than the training.

For each scenario the main process writes to OUTPUT_DIR/SCENARIO/:
- `initial.safetensors`, `final.safetensors`: every parameter before and after training (whole
  tensors; under FSDP the state dict is gathered from every process);
- `log_history.json`: `trainer.state.log_history`;
- `first_round.pt`: the first generation round gathered from every process, in global row
  order: advantages (N,), completion token lists, and the DAPO normaliser (active tokens);
- `run_info.json`: the distributed type and process count the trainer saw, whether the policy and
  reference parameters were sharded (DTensor);
- `train/`: the trainer's output_dir (checkpoints of the scenarios that save).
"""

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType, gather_object
from peft import LoraConfig
from safetensors.torch import save_file
from tiny_models import tiny_llama, tiny_tokenizer
from torch.distributed.tensor import DTensor
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, length_reward, make_config

from grpo_hf import GRPOTrainer
from grpo_hf.data.rollout import Rollout, completion_mask_after_eos


@dataclass(frozen=True)
class Scenario:
    """One short training run, described by its global batch so that any process count can run it."""

    num_generations: int = 4
    global_batch: int = 8  # completions per optimizer step over all processes
    loss_type: str = "dapo"
    lora: bool = False
    num_iterations: int = 1
    max_steps: int = 3
    sync_ref_model: bool = False
    # Plain SGD by default: an update is lr x gradient, so comparing updates compares gradients.
    optim: str = "sgd"
    learning_rate: float = 0.5
    save_steps: int | None = None  # save a checkpoint every save_steps optimizer steps
    completions: str = "fixed"  # a key of TRAINERS: "fixed", "sampled" (the real decode loop), ...
    reward: str = "length"  # a key of REWARDS
    dynamic_sampling: bool = False
    nonfinite_steps: tuple[int, ...] = ()  # optimizer steps (1-based) whose loss is multiplied by inf
    lr_scheduler_type: str = "linear"
    max_completion_length: int = 8
    stream: bool = False  # the train dataset as a datasets.IterableDataset (shuffled through its buffer)
    ds3_gather_for_generation: bool = True
    loss_settings: dict = field(default_factory=dict)  # more GRPOConfig loss settings


SCENARIOS = {
    # 2 processes x 4 completions, G = 4: each process holds exactly one group.
    "g4_dapo": Scenario(num_generations=4, loss_type="dapo"),
    "g4_grpo": Scenario(num_generations=4, loss_type="grpo"),
    # G = 8 straddles the 2 processes: group mean / std need the other process's rewards, and the
    # processes hold different numbers of active tokens. mu = 2 adds old log-probs and ratios != 1.
    "g8_dapo": Scenario(num_generations=8, loss_type="dapo", num_iterations=2, max_steps=4),
    "g8_grpo": Scenario(num_generations=8, loss_type="grpo", num_iterations=2, max_steps=4),
    "g8_dapo_adamw": Scenario(num_generations=8, optim="adamw_torch", learning_rate=1e-2),
    "lora_g8_dapo": Scenario(num_generations=8, lora=True, num_iterations=2, max_steps=4),
    "lora_g4_grpo": Scenario(num_generations=4, loss_type="grpo", lora=True),
    # The reference moves towards the policy after every optimizer step (TR-DPO).
    "sync_ref": Scenario(num_generations=8, sync_ref_model=True),
    # Two optimizer steps and a checkpoint at step 2, which only the main process writes.
    "save": Scenario(num_generations=8, max_steps=2, save_steps=2),
    # The real decode loop; under uneven_stop the processes finish decoding at different steps.
    "sampled": Scenario(num_generations=8, completions="sampled"),
    "uneven_stop": Scenario(num_generations=8, completions="uneven_stop", max_steps=1),
    # The same under ZeRO-3 without gathering the model for generation: the processes decode in
    # lockstep, each layer gathered at each step (elsewhere the setting changes nothing).
    "no_gather_uneven_stop": Scenario(
        num_generations=8, completions="uneven_stop", max_steps=1, ds3_gather_for_generation=False
    ),
    "lora_uneven_stop": Scenario(num_generations=8, lora=True, completions="uneven_stop", max_steps=2),
    # DAPO dynamic sampling: half the prompts give every completion the same reward, so groups are
    # dropped and extra rounds generated; the kept groups move between processes.
    "dynamic": Scenario(num_generations=4, global_batch=16, reward="half_constant", dynamic_sampling=True),
    # Step 2 of 3 has non-finite gradients: skipped and counted by every backend (under DeepSpeed the
    # step runs inside backward). A constant learning rate, because DeepSpeed does not advance the
    # scheduler on a skipped step and the plain Trainer does.
    "nonfinite": Scenario(num_generations=8, nonfinite_steps=(2,), lr_scheduler_type="constant"),
    # Two-turn tool episodes (a call of `add`, its result, an answer): the tool results' tokens are
    # in the context but out of the loss, on every process.
    "tools": Scenario(num_generations=8, completions="tools", max_completion_length=256),
    # A streamed train dataset: every process reads the whole stream and keeps its slice of each
    # batch, so G = 8 straddles the processes as with the sampler. 3 steps of 2 prompts over 4
    # prompts: the third round starts the stream's second (reshuffled) pass.
    "stream": Scenario(num_generations=8, global_batch=16, stream=True),
    # g8_dapo and g8_grpo with their log-prob passes cut by tokens: rows of 36 to 39 tokens on process 0
    # fit 2 passes of 80, rows of 40 to 43 on process 1 need 4, so process 0 cuts its rows into 4 too (the
    # old and reference passes of the round and the policy pass of its one micro-batch alike); on 2
    # processes the rows are dealt by tokens first.
    "token_budget": Scenario(
        num_generations=8, num_iterations=2, max_steps=4, loss_settings=dict(token_budget=80)
    ),
    "token_budget_grpo": Scenario(
        num_generations=8,
        loss_type="grpo",
        num_iterations=2,
        max_steps=4,
        loss_settings=dict(token_budget=80),
    ),
    # The entropy quantile over both processes' tokens, the adaptive entropy coefficient from both
    # processes' entropy and its bonus over both processes' tokens, the off-policy mask on the
    # second pass.
    "masks": Scenario(
        num_generations=8,
        num_iterations=2,
        max_steps=4,
        loss_settings=dict(
            top_entropy_quantile=0.5,
            off_policy_mask_threshold=0.0,
            use_adaptive_entropy=True,
            entropy_target=100.0,
            entropy_coef_delta=0.01,
        ),
    ),
}


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def half_constant_reward(completions, answer, **kwargs) -> list[float]:
    """length_reward on odd prompts (answer 2, 6, ...); the same reward for every completion on even ones."""
    lengths = length_reward(completions)
    return [value if int(a) % 4 == 2 else 1.0 for value, a in zip(lengths, answer, strict=True)]


def logged_length_reward(completions, log_metric, log_extra, **kwargs) -> list[float]:
    """length_reward, also logging its batch mean (log_metric: a mean over every process's calls) and a
    table column (log_extra: gathered with the rows, dynamic sampling included)."""
    rewards = length_reward(completions)
    log_metric("length_reward_mean", sum(rewards) / len(rewards))
    log_extra("length", rewards)
    return rewards


logged_length_reward.__name__ = "length_reward"  # the metric names of length_reward


REWARDS = {"length": logged_length_reward, "half_constant": half_constant_reward}


class RecordingTrainer(FixedCompletionsTrainer):
    """Keeps the first training round's advantages, completions and DAPO normaliser, in global order."""

    first_round: dict | None = None
    nonfinite_steps: tuple[int, ...] = ()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs)
        return loss * math.inf if self.state.global_step + 1 in self.nonfinite_steps else loss

    def _generate_and_score(self, rows: list[dict]) -> list[dict[str, torch.Tensor]]:
        parts = super()._generate_and_score(rows)
        if self.first_round is None and self.model.training:
            completions = [
                ids[-mask.shape[0] :][mask.bool()].tolist()
                for part in parts
                for ids, mask in zip(part["input_ids"], part["completion_mask"], strict=True)
            ]
            local_advantages = torch.cat([part["advantages"] for part in parts])  # (n,)
            self.first_round = {
                "advantages": self.accelerator.gather(local_advantages).cpu(),  # (N,)
                "completions": gather_object(completions),
                "dapo_normalizer": float(parts[0]["dapo_normalizer"])
                * self.accelerator.num_processes
                * self.args.steps_per_generation,
            }
        return parts


class SamplingTrainer(RecordingTrainer):
    """The real decode loop instead of fixed completions."""

    generate_completions = GRPOTrainer.generate_completions


class UnevenStopTrainer(SamplingTrainer):
    """Every token ends a completion on the main process only: it stops decoding after one token,
    while the other processes decode up to max_completion_length.

    Records how many modules carried forward pre-hooks while decoding (ZeRO-3's per-module
    gathering hooks, which the whole-model gather removes; 0 without ZeRO-3)."""

    hooked_modules_in_decoding = 0

    def generate_completions(self, prompt_ids, prompt_mask):
        if self.accelerator.is_main_process:
            every_token = list(range(self.model.config.vocab_size))
            self.sampling = dataclasses.replace(self.sampling, eos_token_ids=every_token)
        root = self.accelerator.unwrap_model(self.model)

        def count(module, args):
            hooked = sum(bool(m._forward_pre_hooks) for m in root.modules() if m is not root)
            self.hooked_modules_in_decoding = max(self.hooked_modules_in_decoding, hooked)

        handle = root.register_forward_pre_hook(count)
        try:
            return super().generate_completions(prompt_ids, prompt_mask)
        finally:
            handle.remove()


class ToolEpisodesTrainer(RecordingTrainer):
    """Scripted two-turn episodes: the first turn calls `add` with a = 10 ** (the row's place in its
    group; the last place calls an unknown tool, a failed call), the turn after the tool result
    answers "done". Rows are counted over the whole batch as
    in `FixedCompletionsTrainer` (every episode has both turns, so each turn sees the whole local
    batch), so 1 and N processes run the same episodes."""

    def generate_completions(self, prompt_ids, prompt_mask, max_new_tokens=None):
        tokenizer, width = self.processing_class, max_new_tokens or self.args.max_completion_length
        offset = self.accelerator.process_index * len(prompt_ids)  # global index of local row 0
        rows = []
        for i, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask, strict=True)):
            place = (offset + i) % self.args.num_generations
            answered = "<|im_start|>tool" in tokenizer.decode(ids[mask.bool()])
            name = "sub" if place == self.args.num_generations - 1 else "add"
            call = f'<tool_call>{{"name": "{name}", "arguments": {{"a": {10**place}, "b": 3}}}}</tool_call>'
            tokens = tokenizer("done" if answered else call, add_special_tokens=False)["input_ids"]
            rows.append((tokens + [self.eos_token_ids[0]] + [tokenizer.pad_token_id] * width)[:width])
        completion_ids = torch.tensor(rows, device=prompt_ids.device)  # (B, C)
        mask, truncated = completion_mask_after_eos(completion_ids, self.eos_token_ids)
        return Rollout(prompt_ids, prompt_mask, completion_ids, mask, truncated)


TRAINERS = {
    "fixed": RecordingTrainer,
    "sampled": SamplingTrainer,
    "uneven_stop": UnevenStopTrainer,
    "tools": ToolEpisodesTrainer,
}


def force_fsdp_on_cpu() -> None:
    """Make an FSDP launch really shard on a CPU-only machine.

    Accelerate enables FSDP only on top of a GPU-style multi-process state; on CPUs the state is
    MULTI_CPU and the FSDP plugin is silently dropped (the run is plain DDP). Relabelling the state
    before the Trainer builds its Accelerator runs the FSDP2 code path (`fully_shard` over gloo on
    the CPU) as it would run on GPUs.
    """
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    if PartialState().distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def is_sharded(model: torch.nn.Module | None) -> bool:
    """Parameters are FSDP2 DTensor shards or ZeRO-3 partitions (which carry a ds_id)."""
    return model is not None and any(
        isinstance(p, DTensor) or hasattr(p, "ds_id") for p in model.parameters()
    )


def run(name: str, scenario: Scenario, output: str, world_size: int) -> None:
    folder = os.path.join(output, name)
    args = make_config(
        os.path.join(folder, "train"),
        per_device_train_batch_size=scenario.global_batch // world_size,
        num_generations=scenario.num_generations,
        loss_type=scenario.loss_type,
        num_iterations=scenario.num_iterations,
        max_steps=scenario.max_steps,
        optim=scenario.optim,
        learning_rate=scenario.learning_rate,
        max_grad_norm=0.0,
        sync_ref_model=scenario.sync_ref_model,
        ref_model_sync_steps=1,
        save_strategy="steps" if scenario.save_steps else "no",
        save_steps=scenario.save_steps or 500,
        ddp_find_unused_parameters=False,
        dynamic_sampling=scenario.dynamic_sampling,
        max_dynamic_sampling_rounds=3,
        lr_scheduler_type=scenario.lr_scheduler_type,
        max_completion_length=scenario.max_completion_length,
        ds3_gather_for_generation=scenario.ds3_gather_for_generation,
        **scenario.loss_settings,
    )
    force_fsdp_on_cpu()
    peft_config = (
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if scenario.lora else None
    )
    trainer = TRAINERS[scenario.completions](
        model=tiny_llama(),
        reward_funcs=REWARDS[scenario.reward],
        args=args,
        train_dataset=chat_dataset(4 if scenario.stream else 8).to_iterable_dataset()
        if scenario.stream
        else chat_dataset(8),
        processing_class=tiny_tokenizer(),
        peft_config=peft_config,
        tools=[add] if scenario.completions == "tools" else None,
    )
    trainer.nonfinite_steps = scenario.nonfinite_steps
    initial = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    # get_state_dict gathers whole tensors under FSDP and ZeRO-3: a collective, every process calls it.
    # Under DeepSpeed it takes the engine, which the Trainer keeps as model_wrapped.
    final = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    info = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "policy_sharded": is_sharded(trainer.model),
        "reference_sharded": is_sharded(trainer.ref_model),
    }
    if isinstance(trainer, UnevenStopTrainer):
        info["hooked_modules_in_decoding"] = trainer.hooked_modules_in_decoding
    if trainer.accelerator.is_main_process:
        os.makedirs(folder, exist_ok=True)
        save_file(initial, os.path.join(folder, "initial.safetensors"))
        save_file(
            {n: final[n].detach().cpu().clone().contiguous() for n in initial},
            os.path.join(folder, "final.safetensors"),
        )
        with open(os.path.join(folder, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f, indent=1)
        with open(os.path.join(folder, "run_info.json"), "w") as f:
            json.dump(info, f, indent=1)
        torch.save(trainer.first_round, os.path.join(folder, "first_round.pt"))
    trainer.accelerator.wait_for_everyone()


def main(argv: list[str]) -> None:
    output, names = argv[0], argv[1:]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for name in names:
        start = time.perf_counter()
        run(name, SCENARIOS[name], output, world_size)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[dist_worker] {name}: {time.perf_counter() - start:.1f} s on {world_size} process(es)")
    exit_worker()


def exit_worker() -> None:
    """End a launched worker once its results are written."""
    # Left to interpreter exit, the process group's threads are destroyed while still running, and a
    # process can abort (SIGABRT, "terminate called without an active exception") after all is done.
    PartialState().destroy_process_group()
    # Even then FSDP2 runs still aborted that way now and then (3 of 7 full runs on one day; and
    # tests/server_worker.py's FSDP2 run 2 of about 6 after it destroyed its group): here the group
    # outlives destroy_process_group, held by DeepSpeed's default arguments and the trainer's
    # reference cycles (what `grpo_hf_cli.grpo.run` undoes for the command line). Every result is
    # written by now, so leave without running C++ destructors. Errors above still raise.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
