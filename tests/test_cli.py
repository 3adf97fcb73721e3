"""The command line (grpo_hf_cli): `grpo-hf grpo` with TRL's arguments, `grpo-hf env`, and the pieces
they are made of (reward names, local data files, the accelerate launch words). The end-to-end runs
start `python -m grpo_hf_cli` (what the `grpo-hf` console script runs) in a subprocess on a tiny
Llama saved to a folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import free_port

import grpo_hf.rewards
from grpo_hf import DatasetMixtureConfig, GRPOConfig
from grpo_hf.engine import native_bf16
from grpo_hf.models import loading
from grpo_hf.script_utils import load_script_dataset
from grpo_hf_cli import env, launch
from grpo_hf_cli.grpo import GRPOScriptArguments, check_settings, load_data, make_parser
from grpo_hf_cli.rewards import REWARD_FUNCS, reward_funcs

ROOT = Path(__file__).resolve().parent.parent
# grpo_hf.rewards' names that are no reward by themselves: text helpers, and a factory without defaults.
NOT_REWARDS = {
    "answer_tag_content",
    "completion_text",
    "evaluate_expression",
    "extract_answer",
    "extract_equation",
    "final_answer_text",
    "make_overlong_reward",
}


def config(tmp_path, **overrides) -> GRPOConfig:
    settings = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=2)
    return GRPOConfig(**settings | overrides)


def test_every_reward_of_grpo_hf_rewards_has_a_name():
    assert set(REWARD_FUNCS) == set(grpo_hf.rewards.__all__) - NOT_REWARDS


def test_trls_names_mean_what_trl_grpo_makes_of_them(tmp_path):
    accuracy, overlong, cosine = reward_funcs(
        ["accuracy_reward", "get_soft_overlong_punishment", "get_cosine_scaled_reward"],
        config(tmp_path, max_completion_length=100),
    )
    assert accuracy is grpo_hf.rewards.accuracy_reward
    # TRL's values: max_completion_len=1280, soft_punish_cache=256. 1100 tokens: (1024 - 1100) / 256.
    assert overlong(completion_ids=[[0] * 1100, [0] * 1024, [0] * 1300]) == [-76 / 256, 0.0, -1.0]
    assert overlong.__name__ == "soft_overlong_punishment_reward"
    # max_len is the run's max_completion_length: a right answer of 100 tokens gets min_value_correct.
    assert cosine(completions=["\\boxed{2}"], completion_ids=[[0] * 100], solution=["2"]) == [0.5]


def test_a_dotted_path_is_imported_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # undone after the test, whatever reward_funcs adds
    (short,) = reward_funcs(["my_rewards.short"], config(tmp_path))
    assert short(completions=["a", "b"]) == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"my_rewards.long: my_rewards has no 'long'"):
        reward_funcs(["my_rewards.long"], config(tmp_path))
    with pytest.raises(ValueError, match=r"--reward_funcs nowhere.f: cannot import nowhere \(looked in "):
        reward_funcs(["nowhere.f"], config(tmp_path))


def settings(*words: str) -> tuple:
    return make_parser().parse_args_and_config(["--output_dir", "out", "--use_cpu", *words])


@pytest.mark.parametrize(
    ("words", "said"),
    [
        ([], "Nothing to train on: give --dataset_name"),
        (["--dataset_name", "d.jsonl"], "No reward: give --reward_funcs"),
        (
            ["--dataset_name", "d.jsonl", "--reward_funcs", "acuracy_reward"],
            "did you mean accuracy_reward or reasoning_accuracy_reward?",
        ),
        (["--task", "arithmetic", "--dataset_name", "d.jsonl"], "--task brings its own data"),
        (["--task", "chess"], "task='chess' is not one of ['arithmetic', 'calculator', 'countdown']"),
        (["--task", "arithmetic", "--merge_adapter", "true"], "--merge_adapter merges a LoRA adapter"),
    ],
)
def test_settings_that_cannot_train_are_refused_while_parsing(words, said):
    with pytest.raises(ValueError) as error:
        check_settings(*settings(*words))
    assert said in str(error.value)


def test_a_task_and_a_reward_model_need_no_reward_funcs(monkeypatch):
    monkeypatch.setattr(loading, "_hub_reachable", lambda: True)
    check_settings(*settings("--task", "arithmetic"))
    check_settings(*settings("--dataset_name", "d", "--reward_model_name_or_path", "some/rm"))


def test_a_reward_model_that_cannot_be_had_is_refused_while_parsing(tmp_path, monkeypatch, model_dir):
    """A reward model that cannot be had failed only once the trainer loaded it, after the policy (or,
    with no network, after the hub client's retries)."""
    monkeypatch.setattr(loading, "is_offline_mode", lambda: True)
    monkeypatch.setattr(loading.hub_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(OSError) as error:
        check_settings(*settings("--dataset_name", "d", "--reward_model_name_or_path", "someone/no-such-rm"))
    assert str(error.value) == (
        "reward_model_name_or_path='someone/no-such-rm': it is not a local folder, the Hugging Face cache has no "
        "copy of it, and the hub cannot be reached (offline mode); pass a local folder with config.json or a hub id"
    )
    with pytest.raises(ValueError, match=f"the folder {tmp_path} has no config.json"):
        check_settings(*settings("--dataset_name", "d", "--reward_model_name_or_path", str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="'./no-such-rm': there is no such folder"):
        check_settings(*settings("--dataset_name", "d", "--reward_model_name_or_path", "./no-such-rm"))
    (tmp_path / "models--someone--cached-rm").mkdir()  # in the cache: from_pretrained loads it offline
    check_settings(*settings("--dataset_name", "d", "--reward_model_name_or_path", "someone/cached-rm"))
    check_settings(*settings("--dataset_name", "d", "--reward_model_name_or_path", str(model_dir)))


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".tsv", ".parquet", ".jsonl.gz"])
def test_a_local_data_file_is_the_train_split(tmp_path, suffix):
    import datasets

    rows = datasets.Dataset.from_list(
        [{"prompt": "1+1?", "solution": "two"}, {"prompt": "2+2?", "solution": "four"}]
    )
    path = tmp_path / f"my{suffix}"
    if suffix in (".csv", ".tsv"):
        rows.to_csv(path, sep="," if suffix == ".csv" else "\t")
    elif suffix == ".parquet":
        rows.to_parquet(path)
    else:
        rows.to_json(path, compression="gzip" if suffix.endswith(".gz") else None)
    loaded = load_script_dataset(GRPOScriptArguments(dataset_name=str(path)))
    assert list(loaded) == ["train"] and loaded["train"].to_list() == rows.to_list()


def test_streaming_and_a_mixture_from_the_config(tmp_path):
    import datasets

    write_jsonl(tmp_path / "my.jsonl", count=4)
    streamed = load_script_dataset(
        GRPOScriptArguments(dataset_name=str(tmp_path / "my.jsonl"), dataset_streaming=True)
    )
    assert isinstance(streamed["train"], datasets.IterableDataset) and len(list(streamed["train"])) == 4
    (tmp_path / "mix.yaml").write_text(
        f"datasets:\n  - path: json\n    data_files: {tmp_path / 'my.jsonl'}\n    columns: [prompt]\n"
        "test_split_size: 0.5\nreward_funcs: [think_format_reward]\n"
    )
    script, args, _, mixture = make_parser().parse_args_and_config(
        ["--config", str(tmp_path / "mix.yaml"), "--output_dir", "out", "--use_cpu"]
    )
    data = load_data(script, args, mixture)
    assert data.num_rows == {"train": 2, "test": 2} and data["train"].column_names == ["prompt"]


def test_a_file_without_a_reader_and_a_missing_split_are_named(tmp_path):
    (tmp_path / "my.xlsx").write_text("x")
    with pytest.raises(ValueError, match=r"has no reader for by its extension '.xlsx'"):
        load_script_dataset(GRPOScriptArguments(dataset_name=str(tmp_path / "my.xlsx")))
    (tmp_path / "my.jsonl").write_text('{"prompt": "1+1?"}\n')
    script = GRPOScriptArguments(dataset_name=str(tmp_path / "my.jsonl"))
    with pytest.raises(ValueError, match=r"no split 'test' \(its splits: \['train'\]\)"):
        load_data(script, config(tmp_path, eval_strategy="steps", eval_steps=1), DatasetMixtureConfig())


def test_the_words_no_setting_takes_go_to_accelerate_launch(tmp_path):
    from_file = ["--num_processes", "2", "--multi_gpu", "True", "--same_network", "False"]
    assert launch.accelerate_arguments(from_file, ["--main_process_port", "29501"]) == [
        "--num_processes", "2", "--multi_gpu", "--main_process_port", "29501",
    ]  # fmt: skip
    (tmp_path / "zero2.yaml").write_text("distributed_type: DEEPSPEED\n")
    words = launch.accelerate_arguments([], ["--accelerate_config", str(tmp_path / "zero2.yaml")])
    assert words == ["--config_file", str(tmp_path / "zero2.yaml")]
    with pytest.raises(ValueError, match=r"--accelerate_config zero2: no such file. grpo-hf ships no named"):
        launch.accelerate_arguments([], ["--accelerate_config", "zero2"])
    with pytest.raises(ValueError) as error:
        launch.accelerate_arguments([], ["--num_proceses", "2", "--lerning_rate", "1"])
    assert str(error.value) == (
        "unknown settings --num_proceses (did you mean --num_processes or --main_process_ip or --num_test?), "
        "--lerning_rate (did you mean "
        "--learning_rate or --logging_strategy or --merge_adapter?): neither a grpo-hf setting nor an "
        "accelerate launch flag"
    )
    with pytest.raises(
        ValueError, match=r"accelerate launch: argument --num_processes/--num-processes: invalid int value"
    ):
        launch.accelerate_arguments([], ["--num_processes", "two"])


def test_the_script_gets_the_command_line_less_the_launch_words():
    words = ["--num_generations", "2", "--num_processes", "2", "--beta", "2"]
    assert launch._without(words, ["--num_processes", "2"]) == ["--num_generations", "2", "--beta", "2"]


def test_env_says_what_a_bug_report_needs():
    info = env.environment()
    for name in ("grpo-hf", "PyTorch", "Transformers", "Accelerate", "PEFT", "Datasets", "vLLM"):
        assert f"{name} version" in info
    assert info["grpo-hf version"].startswith(grpo_hf.__version__)
    assert f"precision: {info['precision: auto picks']}" == native_bf16(use_cpu=True)[1]  # no GPU here
    assert info["GPUs"].startswith("none")
    assert info["Python version"] == ".".join(map(str, sys.version_info[:3]))


def run_cli(*words: str, cwd: Path = ROOT, env_vars: dict | None = None) -> subprocess.CompletedProcess:
    env_vars = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", **(env_vars or {})}
    command = [sys.executable, "-m", "grpo_hf_cli", *words]
    return subprocess.run(command, cwd=cwd, env=env_vars, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def write_jsonl(path: Path, count: int = 8) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "solution": str(2 * i)}) + "\n" for i in range(count)
        )
    )
    return path


@pytest.mark.slow
def test_my_jsonl_trains_a_lora_adapter_in_one_command(model_dir, tmp_path):
    """The issue's new user: a JSONL file of prompt / solution rows, TRL's flags, one command."""
    write_jsonl(tmp_path / "my.jsonl")
    done = run_cli(
        "grpo", "--model_name_or_path", str(model_dir), "--dataset_name", "my.jsonl",
        "--reward_funcs", "accuracy_reward", "--use_peft", "--lora_target_modules", "q_proj", "v_proj",
        "--output_dir", "out", "--per_device_train_batch_size", "4", "--num_generations", "2",
        "--max_completion_length", "8", "--max_steps", "2", "--logging_steps", "1", "--report_to", "none",
        "--save_steps", "2", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (
        sorted(adapter["target_modules"]) == ["q_proj", "v_proj"] and adapter["lora_dropout"] == 0.05
    )  # TRL's
    assert (out / "adapter_model.safetensors").is_file()
    card = (out / "README.md").read_text()  # the model card, naming the run's data as TRL's does
    assert "my.jsonl" in card and "- grpo-hf" in card and "accuracy_reward" in card
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "rewards/accuracy_reward/mean" in entry] == [
        1,
        2,
    ]


@pytest.mark.slow
def test_two_processes_from_the_config_files_launch_keys(model_dir, tmp_path):
    """Keys of the --config file that no setting has are accelerate launch's, as in TRL: here two
    processes (gloo on the CPU), each scoring with a reward found by its dotted path. At exit no
    thread of the process group is left: one that outlives it can abort a finished run (SIGABRT)."""
    write_jsonl(tmp_path / "data.jsonl")
    (tmp_path / "rank_rewards.py").write_text(
        "import atexit, glob, os\n\n"
        "def name(path):\n"
        "    try:\n        return open(path).read().strip()\n"
        "    except OSError:  # a thread that ended since the glob\n        return ''\n\n"
        "def threads_at_exit():\n"
        "    names = [name(path) for path in glob.glob('/proc/self/task/*/comm')]\n"
        "    with open(f\"threads{os.environ['RANK']}.txt\", 'w') as f:\n        f.write(' '.join(names))\n\n"
        "atexit.register(threads_at_exit)\n\n"
        "def rank_reward(completions, **kwargs):\n"
        "    with open(f\"rank{os.environ['RANK']}.txt\", 'a') as f:\n        f.write('scored\\n')\n"
        "    return [0.0] * len(completions)\n"
    )
    (tmp_path / "run.yaml").write_text(
        f"num_processes: 2\nmulti_gpu: true\nmain_process_port: {free_port()}\nnum_cpu_threads_per_process: 1\n"
        f"model_name_or_path: {model_dir}\nuse_peft: false\nper_device_train_batch_size: 2\nnum_generations: 2\n"
        "max_completion_length: 4\nmax_steps: 1\nreport_to: none\nsave_strategy: 'no'\noutput_dir: out\n"
    )
    done = run_cli(
        "grpo",
        "--config",
        "run.yaml",
        "--dataset_name",
        "data.jsonl",
        "--reward_funcs",
        "rank_rewards.rank_reward",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "rank0.txt").is_file() and (tmp_path / "rank1.txt").is_file()
    assert (tmp_path / "out" / "model.safetensors").is_file()
    for rank in (0, 1):
        threads = (tmp_path / f"threads{rank}.txt").read_text().split()
        # the main thread at least, and none of the process group's
        assert threads and not [name for name in threads if "gloo" in name], threads


@pytest.mark.slow
def test_mistakes_are_one_line_before_anything_starts(tmp_path):
    typo = run_cli("grpo", "--task", "arithmetic", "--lerning_rate", "1")
    assert typo.returncode == 2
    assert typo.stderr.strip().splitlines() == [
        "grpo-hf grpo: error: unknown setting --lerning_rate (did you mean --learning_rate or --logging_strategy "
        "or --merge_adapter?): neither a grpo-hf setting nor an accelerate launch flag (`grpo-hf grpo --help` "
        "lists the settings)"
    ]
    # An unknown model offline: refused while parsing, naming the built-in model, with no hub retries.
    model = run_cli(
        "grpo",
        "--task",
        "arithmetic",
        "--model_name_or_path",
        "someone/no-such-model",
        env_vars={"HF_HUB_OFFLINE": "1"},
    )
    assert model.returncode == 2 and "Retrying" not in model.stderr
    assert "built-in model ('smollm2-135m-instruct': no hub needed)" in model.stderr
    reward_model = run_cli(
        "grpo",
        "--dataset_name",
        "data.jsonl",
        "--reward_model_name_or_path",
        "someone/no-such-rm",
        env_vars={"HF_HUB_OFFLINE": "1"},
    )
    assert reward_model.returncode == 2 and len(reward_model.stderr.strip().splitlines()) == 1
    assert "reward_model_name_or_path='someone/no-such-rm': it is not a local folder" in reward_model.stderr
    missing = run_cli("grpo", "--config", "recipes/configs/smollm2_lora_arithmetc.yaml")
    assert missing.returncode == 2
    assert (
        "no such file; YAML files in recipes/configs/, the closest first: recipes/configs/smollm2_lora_arithmetic.yaml"
        in missing.stderr
    )


@pytest.mark.slow
def test_help_and_env_from_the_console_script():
    grouped = run_cli("grpo", "--help")
    assert grouped.returncode == 0 and len(grouped.stdout.splitlines()) < 250
    assert "script: rewards, or a built-in task and its evaluation (--help script):" in grouped.stdout
    report = run_cli("env")
    assert report.returncode == 0 and "- precision: auto picks: " in report.stdout
    assert run_cli().stdout.startswith("usage: grpo-hf")


def test_the_console_script_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert '\n[project.scripts]\ngrpo-hf = "grpo_hf_cli.main:main"\n' in text
    assert 'include = ["grpo_hf", "grpo_hf.*", "grpo_hf_cli", "grpo_hf_cli.*"]' in text


def test_the_recipe_and_the_console_script_are_one_script():
    recipe = (ROOT / "recipes" / "grpo.py").read_text()
    assert "from grpo_hf_cli.grpo import run" in recipe and len(recipe.splitlines()) < 25
