"""`grpo-hf grpo` takes a `trl grpo` command line with the meaning TRL 1.16's parser gives it.

Each command line is parsed by TRL's own script parser (trl/scripts/grpo.py's `make_parser`, in an
environment with TRL 1.16: the Python in $GRPO_HF_TRL_PYTHON, or this one where it imports trl)
and by ours (bench/trl_cli_parse.py, both sides): every flag given must end up as the same value,
and the same words must be left for `accelerate launch`. Skipped without TRL; this project's
machines keep it in /work/venv-trl (`python3 -m venv /work/venv-trl && /work/venv-trl/bin/pip
install torch==2.13.0 trl==1.16.0`), never in the main environment.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "trl_cli_parse.py"


def trl_python() -> str | None:
    named = os.environ.get("GRPO_HF_TRL_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("trl") is not None else None


pytestmark = pytest.mark.skipif(
    trl_python() is None,
    reason="needs TRL 1.16: set GRPO_HF_TRL_PYTHON to the Python of an environment with it",
)

# The end-to-end command line of tests/test_cli.py, as a TRL user on a CPU machine writes it (TRL's
# bf16 default would stop it on a CPU without --bf16 false), and one more flag for accelerate.
TRAIN_MY_JSONL = (
    "--model_name_or_path tiny --dataset_name my.jsonl --reward_funcs accuracy_reward --use_peft "
    "--lora_target_modules q_proj v_proj --output_dir out --per_device_train_batch_size 4 --num_generations 2 "
    "--max_completion_length 8 --max_steps 2 --learning_rate 1e-4 --logging_steps 1 --report_to none "
    "--bf16 false --num_processes 2"
)
# Flags of every dataclass, TRL's spellings (hyphens, none, --no_x) included.
EVERY_SECTION = (
    "--dataset_name trl-lib/DeepMath-103K --dataset_config default --dataset_train_split tr "
    "--dataset_test_split te --dataset_streaming true --reward_model_name_or_path some/rm "
    "--reward_funcs accuracy_reward think_format_reward my_lib.rewards.f get_soft_overlong_punishment "
    "--model_name_or_path some/model --model_revision v1 --dtype bfloat16 --attn_implementation sdpa "
    "--use_peft --lora_r 8 --lora_alpha 16 --lora_dropout 0.0 --lora_target_modules all-linear "
    "--lora_modules_to_save lm_head --use_rslora --use_dora true --load_in_4bit --bnb_4bit_quant_type fp4 "
    "--use_bnb_nested_quant --bnb_4bit_quant_storage uint8 "
    "--loss_type dapo --beta 0.04 --epsilon 0.2 --epsilon_high 0.28 --scale_rewards batch "
    "--importance_sampling_level sequence --num_iterations 2 --mask_truncated_completions true "
    "--temperature 0.7 --top_p 0.9 --top_k 50 --min_p none --repetition_penalty 1.1 --num-generations 4 "
    "--max_completion_length 64 --steps_per_generation 2 --reward_weights 1.0 0.5 2.0 1.0 "
    "--vllm_mode server --vllm_server_host 10.0.0.1 --vllm_server_port 8001 --log_completions true "
    "--num_completions_to_print none --no_gradient_checkpointing --bf16 false --use_cpu --seed 3 "
    "--output_dir out --gradient_accumulation_steps 2 --lr_scheduler_type cosine --warmup_steps 5 "
    "--save_strategy steps --save_steps 10 --eval_strategy no --push_to_hub false "
    "--multi_gpu --main_process_port 29501"
)


def parsed(python: str, side: str, words: list[str], cwd: Path) -> dict:
    done = subprocess.run(
        [python, str(SCRIPT), "--side", side, "--", *words],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("command", [TRAIN_MY_JSONL, EVERY_SECTION], ids=["train-my-jsonl", "every-section"])
def test_trl_and_ours_read_a_command_line_alike(command, tmp_path):
    words = command.split()
    trl, ours = parsed(trl_python(), "trl", words, tmp_path), parsed(sys.executable, "ours", words, tmp_path)
    assert "error" not in trl and "error" not in ours, (trl, ours)
    assert ours["values"] == trl["values"]
    launch = [word for word in trl["from_command_line"] if word.startswith("--")]
    assert launch == (
        ["--num_processes"] if command == TRAIN_MY_JSONL else ["--multi_gpu", "--main_process_port"]
    )
    # Every other flag was read, none dropped: one value per flag.
    assert len(trl["values"]) == len([word for word in words if word.startswith("--")]) - len(launch)
    assert ours["from_command_line"] == trl["from_command_line"]  # for accelerate launch


@pytest.mark.slow
def test_trl_and_ours_read_a_config_file_alike(tmp_path):
    """The YAML file's settings become defaults, the command line wins, and keys no dataclass has
    (accelerate launch's, as TRL's CLI hands them on) come back alike."""
    (tmp_path / "grpo.yaml").write_text(
        "dataset_name: data\nreward_funcs: [accuracy_reward]\nbeta: 0.1\nlora_r: 4\nuse_peft: true\n"
        "num_processes: 2\nmixed_precision: 'no'\nbf16: false\noutput_dir: out\n"
    )
    words = ["--config", "grpo.yaml", "--beta", "0.2", "--lora_alpha", "8"]
    trl, ours = parsed(trl_python(), "trl", words, tmp_path), parsed(sys.executable, "ours", words, tmp_path)
    assert ours["values"] == trl["values"]
    assert trl["values"] == {
        "dataset_name": "data",
        "reward_funcs": ["accuracy_reward"],
        "beta": 0.2,
        "use_peft": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "bf16": False,
        "output_dir": "out",
    }
    assert ours["from_file"] == trl["from_file"] == ["--num_processes", "2", "--mixed_precision", "no"]
