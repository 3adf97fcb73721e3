"""One of 2 trainer processes sharing one vLLM server; launched by `accelerate launch`.

    python tests_vllm/server_worker.py <server url> <output folder>

The trainers run at the machine's precision (precision='auto'). Both processes hold 2 rows of the same prompt (one group of 4 split between them): the server gets
one request with n = 4 and each process its own 2 samples. Then 2 training steps. Writes
<output>/process-<i>.json.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import completions, make_trainer  # noqa: E402


def main(url: str, output: Path) -> None:
    settings = dict(
        use_vllm=True, vllm_mode="server", vllm_server_base_url=url, per_device_train_batch_size=2,
        precision="auto",
    )  # fmt: skip
    trainer = make_trainer(output, max_steps=2, **settings)
    index = trainer.accelerator.process_index
    result = trainer._sample_and_score([trainer.train_dataset[0]] * 2).result
    trainer.train()
    lora = sum(float(p.double().sum()) for n, p in trainer.model.named_parameters() if "lora_B" in n)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    report = {
        "completions": completions(result),
        "lora_B_sum": lora,
        "ratios": [entry["sampler/ratio_mean"] for entry in logs],
        "ratio_maxes": [entry["sampler/ratio_max"] for entry in logs],
        "bf16": trainer.args.bf16,
    }
    (output / f"process-{index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
