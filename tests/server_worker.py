"""One process of a 2-process run against a vLLM(-like) server; launched by `accelerate launch`.

    python tests/server_worker.py <server url> <output folder> tools|full|lora|async|uneven|async-turns

tools: each process runs a tool episode on its own rows (process 0's rows call the tool, so it
takes two turns while process 1's take one) and writes its episodes' messages to
<output>/process-<i>.json; then both train one step. full: full fine-tuning for two steps (under
FSDP2 or ZeRO-3 the weights sent to the server are gathered from the shards). lora: the same with a
LoRA policy (r=16 on q_proj / v_proj; under ZeRO-3 every parameter partitioned, where DeepSpeed's
default keeps those of under 1e5 elements, all of the tiny model's, whole) and
vllm_weight_sync='auto' (the adapter alone, against a server that takes LoRA adapters; under
FSDP2 / ZeRO-3 gathered from the shards). async: async GRPO
(max_staleness=1) for four steps; each process writes its log history to <output>/log-<i>.json.
uneven: one step whose rollout_func samples twice on process 0 (first at most 2 tokens) and once on
process 1, and writes each call's completion lengths to <output>/calls-<i>.json. async-turns: one
step of async GRPO with tool episodes, each process one prompt's 4 rows (the server decides how
many turns each takes), ddp_timeout=6 s on the gloo group from the start of training (as NCCL
takes it on GPUs; transformers gives gloo its 30-minute default); each process writes
<output>/trained-<i>. Used by tests/test_vllm_server.py and tests/test_async_grpo.py against a fake
server.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

from dist_worker import exit_worker, force_fsdp_on_cpu
from peft import LoraConfig
from tiny_models import tiny_llama, tiny_tokenizer
from torch.distributed.distributed_c10d import _set_pg_timeout
from trainer_helpers import chat_dataset, length_reward, make_config
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer
from grpo_hf.data import rollout


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def uneven_rollout(output: Path):
    """A rollout_func that samples twice on process 0 (the first call at most 2 tokens) and once on
    process 1, recording each call's completion lengths."""

    def rollout_func(prompts, trainer):
        tokenizer, index = trainer.processing_class, trainer.accelerator.process_index
        texts = [rollout.render_prompt(tokenizer, prompt) for prompt in prompts]
        ids, mask = rollout.tokenize_prompts(tokenizer, texts, None, trainer.accelerator.device)
        limits = [2, None] if index == 0 else [None]
        results = [trainer.generate_completions(ids, mask, limit) for limit in limits]
        lengths = [result.completion_mask.sum(dim=1).tolist() for result in results]
        (output / f"calls-{index}.json").write_text(json.dumps(lengths))
        last = results[-1]
        return {
            "prompt_ids": [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)],
            "completion_ids": [
                row[m.bool()].tolist()
                for row, m in zip(last.completion_ids, last.completion_mask, strict=True)
            ],
            "logprobs": None,
        }

    return rollout_func


class GlooTimeout(TrainerCallback):
    """From the start of training, the gloo group's collectives fail after ddp_timeout."""

    def on_train_begin(self, args, state, control, **kwargs):
        _set_pg_timeout(timedelta(seconds=args.ddp_timeout))


def settings_for(url: str, mode: str) -> dict:
    settings = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, max_completion_length=128)
    settings |= dict(per_device_train_batch_size=4, num_generations=2, max_steps=2 if mode == "full" else 1)
    if mode == "async":
        settings |= dict(max_staleness=1, max_steps=4)
    if mode == "lora":
        settings |= dict(vllm_weight_sync="auto", max_steps=2)
    if mode == "async-turns":
        settings |= dict(max_staleness=1, num_generations=4, max_completion_length=1024, ddp_timeout=6)
        settings |= dict(vllm_server_timeout=5.0, vllm_server_request_timeout=5.0)  # below ddp_timeout
    return settings


def main(url: str, output: Path, mode: str) -> None:
    args = make_config(output, **settings_for(url, mode))
    force_fsdp_on_cpu()  # after the config, which makes the distributed state it relabels
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]) if mode == "lora" else None
    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=args,
        train_dataset=chat_dataset({"async": 16, "async-turns": 2}.get(mode, 4)),
        processing_class=tiny_tokenizer(),
        tools=[add] if mode in ("tools", "async-turns") else None,
        rollout_func=uneven_rollout(output) if mode == "uneven" else None,
        peft_config=lora,
        callbacks=[GlooTimeout()] if mode == "async-turns" else None,
    )
    plugin = trainer.accelerator.state.deepspeed_plugin
    if mode == "lora" and plugin is not None:  # ZeRO-3 partitions every parameter, however small
        plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if mode == "async-turns":
        trainer.train()
        (output / f"trained-{trainer.accelerator.process_index}").write_text(str(trainer.state.global_step))
        return
    if mode in ("full", "lora", "async", "uneven"):
        trainer.train()
        if mode == "async":
            log = json.dumps(trainer.state.log_history)
            (output / f"log-{trainer.accelerator.process_index}.json").write_text(log)
        return
    index = trainer.accelerator.process_index
    rows = [trainer.train_dataset[i] for i in (2 * index, 2 * index, 2 * index + 1, 2 * index + 1)]
    scored = trainer._sample_and_score(rows)
    (output / f"process-{index}.json").write_text(json.dumps(scored.completions))
    trainer.train()
    (output / f"trained-{index}").write_text(str(trainer.state.global_step))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    exit_worker()
