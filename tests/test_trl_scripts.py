"""TRL 1.16 scripts run on grpo-hf with only their import lines changed (`trl` -> `grpo_hf`).

Each script in tests/trl_scripts/ is written against TRL's API as TRL documents it (the quick start,
GRPOConfig's settings from the command line and in code, the reward-function forms of TRL's guide,
tools and an environment that owns a reward) or as TRL's example scripts are written (TrlParser with
a YAML --config, ModelConfig and get_peft_config, a dataset mixture, rewards chosen by name). Here
the import lines are rewritten and nothing else, and the script runs in a subprocess on a tiny Llama
saved to a folder (TRL loads such a folder the same way; there is no model hub on these machines).
"""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tiny_models import LLAMA_LIKE, tiny_llama, tiny_tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification

from grpo_hf import GRPOTrainer

SCRIPTS = Path(__file__).parent / "trl_scripts"
IMPORTS = {
    "from trl import ": "from grpo_hf import ",
    "from trl.rewards import ": "from grpo_hf.rewards import ",
}


# ChatML with tools in the Hermes format (as Qwen2.5's template writes them): TRL 1.16 accepts only a
# template that renders tool calls and tool results, so the tiny model gets one for these scripts.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n{% endif %}'
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}\n<tool_call>\n"
    '{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# How a reply in that template is read back (transformers' `parse_response`): Hermes calls, then text.
HERMES_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


# What TRL 1.16.0 logged at the first step of each script, run unchanged with TRL (transformers 5.23,
# this tiny model, on the CPU; the quick start is not among them: TRL's default bf16 stops it on a
# machine without a GPU; lora_config.py and mixture.py with peft 0.21.2 and the same command lines,
# YAML files and data as the tests below). Every one of these must be in our log too, under the same
# name. Every script's step logged TRL_STEP; all but cli.py (loss_type cispo) also TRL_CLIP; kl only
# where beta > 0.
TRL_STEP = [
    "completions/clipped_ratio",
    "completions/max_length",
    "completions/max_terminated_length",
    "completions/mean_length",
    "completions/mean_terminated_length",
    "completions/min_length",
    "completions/min_terminated_length",
    "entropy",
    "frac_reward_zero_std",
    "grad_norm",
    "learning_rate",
    "loss",
    "num_tokens",
    "reward",
    "reward_std",
    "step_time",
]
TRL_CLIP = [
    "clip_ratio/high_max",
    "clip_ratio/high_mean",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/region_mean",
]


def reward_metrics(*names: str) -> list[str]:
    return [f"rewards/{name}/{stat}" for name in names for stat in ("mean", "std")]


TRL_LOGGED_CUSTOM = [
    *TRL_STEP,
    *TRL_CLIP,
    "accuracy",
    "kl",
    *reward_metrics(
        "async_reward",
        "boxed_reward",
        "char_count_reward",
        "curriculum_reward",
        "format_reward",
        "math_only_reward",
        "token_count_reward",
    ),
]
TRL_LOGGED_AGENT = [
    *TRL_STEP,
    *TRL_CLIP,
    *reward_metrics("Counter", "used_a_tool"),
    "tools/call_frequency",
    "tools/failure_frequency",
]
TRL_LOGGED_CLI = [*TRL_STEP, "cispo_clip_ratio", "kl", *reward_metrics("reward_len")]
TRL_LOGGED_LORA = [*TRL_STEP, *TRL_CLIP, "kl", *reward_metrics("letter_share_reward", "think_format_reward")]
TRL_LOGGED_MIXTURE = [
    *TRL_STEP,
    *TRL_CLIP,
    *reward_metrics("accuracy_reward", "soft_overlong_punishment_reward", "tiny-reward"),
]
# mixture.py's evaluation: its step's metrics under eval_, less the optimizer's, plus the Trainer's timings.
TRL_LOGGED_MIXTURE_EVAL = [
    *(
        f"eval_{name}"
        for name in TRL_LOGGED_MIXTURE
        if name not in ("grad_norm", "learning_rate", "step_time")
    ),
    "eval_runtime",
    "eval_samples_per_second",
    "eval_steps_per_second",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template, tokenizer.response_template = HERMES_TEMPLATE, HERMES_RESPONSE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    """A tiny sequence classifier (one score) and the tokenizer, in a folder named 'tiny-reward'
    (TRL names a reward model's metrics after its folder: rewards/tiny-reward/mean)."""
    folder = tmp_path_factory.mktemp("reward") / "tiny-reward"
    config = LlamaConfig(vocab_size=259, num_labels=1, eos_token_id=2, bos_token_id=1, **LLAMA_LIKE)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def sums(n: int, offset: int = 0, **extra) -> list[dict]:
    """Chat prompts 'What is a + a?' with the `solution` column accuracy_reward reads."""
    return [
        {"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": str(2 * i), **extra}
        for i in range(offset, offset + n)
    ]


def ported(name: str, out: Path) -> Path:
    """The script with its TRL import lines pointed at grpo_hf; fails if any other line mentions trl."""
    lines = (SCRIPTS / name).read_text().splitlines(keepends=True)
    changed = 0
    for i, line in enumerate(lines):
        for trl, ours in IMPORTS.items():
            if line.startswith(trl):
                lines[i], changed = line.replace(trl, ours, 1), changed + 1
    assert changed >= 1
    assert not [line for line in lines if line.startswith(("import trl", "from trl"))]
    path = out / name
    path.write_text("".join(lines))
    return path


def run(script: Path, model_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MODEL": str(model_dir), "OUTPUT_DIR": str(cwd / "out"), "WANDB_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def logged(done: subprocess.CompletedProcess) -> list[dict]:
    """The trainer's log history, which the script prints as its last line."""
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_trl_quick_start_runs_with_defaults(model_dir, tmp_path):
    done = run(ported("quickstart.py", tmp_path), model_dir, tmp_path)
    assert "train_runtime" in done.stdout + done.stderr
    # TRL's default output_dir when no args are given: '<model folder name>-GRPO'.
    assert (tmp_path / f"{model_dir.name}-GRPO").is_dir()


@pytest.mark.slow
def test_trl_settings_and_reward_functions(model_dir, tmp_path):
    history = logged(run(ported("custom_rewards.py", tmp_path), model_dir, tmp_path))
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 2
    assert not set(TRL_LOGGED_CUSTOM) - set(steps[0])  # rewards/<name>/*, log_metric's 'accuracy', ...
    completions = tmp_path / "out" / "_completions"  # log_completions (TRL writes completions/)
    assert sorted(p.name for p in completions.iterdir())[:1] == ["completions_00001.parquet"]


@pytest.mark.slow
def test_trl_agent_with_tools_and_an_environment(model_dir, tmp_path):
    history = logged(run(ported("agent.py", tmp_path), model_dir, tmp_path))
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 2
    assert not set(TRL_LOGGED_AGENT) - set(steps[0])  # the environment's reward, the tool metrics


@pytest.mark.slow
def test_trl_command_line_settings(model_dir, tmp_path):
    args = [
        "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "12", "--max_steps", "2", "--logging_steps", "1", "--loss_type", "cispo",
        "--epsilon_high", "5.0", "--scale_rewards", "none", "--beta", "0.01", "--use_bias_correction_kl",
        "False", "--report_to", "none", "--bf16", "False", "--gradient_checkpointing", "False",
        "--generation_kwargs", '{"suppress_tokens": [5]}', "--chat_template_kwargs", '{"enable_thinking": false}',
        "--shuffle_dataset", "False", "--seed", "3",
    ]  # fmt: skip
    history = logged(run(ported("cli.py", tmp_path), model_dir, tmp_path, *args))
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 2
    assert not set(TRL_LOGGED_CLI) - set(steps[0])


# The reward function the YAML file of lora_config.py names by import path (TRL's 'module.function').
MY_REWARDS = """def letter_share_reward(completions, **kwargs):
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]
"""


@pytest.mark.slow
def test_trl_example_script_with_a_yaml_config_and_lora(model_dir, tmp_path):
    write_jsonl(tmp_path / "data" / "train.jsonl", sums(8))
    write_jsonl(tmp_path / "data" / "test.jsonl", sums(2, offset=8))
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    out = tmp_path / "out"
    args = [
        "--config", str(SCRIPTS / "lora_config.yaml"), "--model_name_or_path", str(model_dir),
        "--output_dir", str(out), "--max_steps", "2", "--lora_r", "4",
    ]  # fmt: skip
    history = logged(run(ported("lora_config.py", tmp_path), model_dir, tmp_path, *args))
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 2  # --max_steps 2 overrides the file's 5
    assert not set(TRL_LOGGED_LORA) - set(steps[0])  # the rewards the file names, kl (its beta)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 16)  # r from the command line, alpha from the file
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    weights = load_file(out / "adapter_model.safetensors")
    # q and v of 2 layers, A and B each; B starts at zero, so a nonzero B is a trained adapter.
    assert len(weights) == 8 and all(".lora_" in name for name in weights)
    assert all(w.abs().max() > 0 for name, w in weights.items() if "lora_B" in name)
    assert not (out / "model.safetensors").exists()


@pytest.mark.slow
def test_trl_grpo_script_with_a_dataset_mixture_and_a_reward_model(model_dir, reward_model_dir, tmp_path):
    write_jsonl(tmp_path / "math.jsonl", sums(8))
    write_jsonl(tmp_path / "extra.jsonl", sums(8, offset=8, source="extra"))  # `columns` drops source
    out = tmp_path / "out"
    args = [
        "--config", str(SCRIPTS / "mixture.yaml"), "--model_name_or_path", str(model_dir),
        "--reward_model_name_or_path", str(reward_model_dir), "--output_dir", str(out),
    ]  # fmt: skip
    done = run(ported("mixture.py", tmp_path), model_dir, tmp_path, *args)
    # Fractions 0.75 : 0.25 of 8 + 8 rows: N = min(8 / 0.75, 8 / 0.25) = 10.67; 8 and round(2.67) = 3
    # rows, 11 in all; test_split_size 3 leaves 8 to train on.
    sizes = [line for line in done.stdout.splitlines() if line.startswith('{"train"')]  # the script's print
    assert [json.loads(line) for line in sizes] == [{"train": 8, "test": 3}]
    history = logged(done)
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 2
    assert not set(TRL_LOGGED_MIXTURE) - set(steps[0])  # the reward model's and the functions' rewards
    evaluations = [entry for entry in history if "eval_reward" in entry]
    assert len(evaluations) == 1 and evaluations[0]["step"] == 2  # eval_steps 2 on the 3 test rows
    assert not set(TRL_LOGGED_MIXTURE_EVAL) - set(evaluations[0])
    assert (out / "model.safetensors").is_file()  # full fine-tuning: no peft_config


def test_trainer_arguments_are_trls_in_trls_order():
    """GRPOTrainer's positional arguments are TRL 1.16's, in its order (a script may pass them so);
    ours come after them."""
    trl_order = [
        "model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class",
        "reward_processing_classes", "callbacks", "optimizers", "quantization_config", "peft_config",
        "tools", "rollout_func", "environment_factory",
    ]  # fmt: skip
    ours = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
    assert ours[: len(trl_order)] == trl_order
