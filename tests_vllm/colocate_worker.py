"""One of 2 processes training with a colocated vLLM engine each; launched by `accelerate launch`.

    python tests_vllm/colocate_worker.py <output folder>

Both run at the machine's precision (precision='auto': the engine and our pass in bf16 where the CPU
has it natively). Writes <output>/process-<i>.json: the largest gap between its engine's sampler log-probs and our
log-prob pass on its own rows, its completions, the logged sampler ratios, and a checksum of the
trained LoRA weights (DDP keeps them equal on both processes).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import vllm_settings  # noqa: E402
from helpers import completions, make_trainer  # noqa: E402

from grpo_hf.engine.logprobs import completion_logps  # noqa: E402


def main(output: Path) -> None:
    trainer = make_trainer(output, max_steps=2, **vllm_settings(precision="auto"))
    index = trainer.accelerator.process_index
    rows = [trainer.train_dataset[2 + index]] * 4  # each process its own prompt
    result = trainer._sample_and_score(rows).result
    with torch.no_grad(), trainer.compute_loss_context_manager():  # the trainer's precision (bf16 autocast)
        ours, _, _ = completion_logps(
            trainer.model, result.input_ids, result.attention_mask, result.completion_ids.shape[1], 1.0
        )  # (B, C)
    gap = (result.sampler_logps - ours.detach()).abs()[result.completion_mask.bool()].max().item()
    trainer.train()
    lora = sum(float(p.double().sum()) for n, p in trainer.model.named_parameters() if "lora_B" in n)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    report = {
        "gap": gap,
        "bf16": trainer.args.bf16,
        "completions": completions(result),
        "ratios": [entry["sampler/ratio_mean"] for entry in logs],
        "ratio_maxes": [entry["sampler/ratio_max"] for entry in logs],
        "lora_B_sum": lora,
        "version": trainer.generator.version,
    }
    (output / f"process-{index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
