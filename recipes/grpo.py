"""GRPO from the command line: TRL's `trl grpo` arguments, or a built-in task with its held-out accuracy.

    accelerate launch --config_file recipes/accelerate/cpu.yaml recipes/grpo.py \\
        --config recipes/configs/smollm2_lora_arithmetic.yaml [--any_setting value ...]
    accelerate launch recipes/grpo.py --model_name_or_path DIR --dataset_name my.jsonl \\
        --reward_funcs accuracy_reward --use_peft --output_dir out

The same script as the console command `grpo-hf grpo` (which starts it through accelerate launch
itself): `grpo_hf_cli.grpo` holds it. `--help` lists the settings by section.
"""

from grpo_hf_cli.grpo import run

if __name__ == "__main__":
    run()
