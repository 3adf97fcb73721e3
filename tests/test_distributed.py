"""Same result on 1 or 2 processes: DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 over gloo on the CPU,
against a single process.

Each backend is one launch of tests/dist_worker.py running every scenario (imports cost more than
the training): a plain single process with the whole global batch, then `accelerate launch` with
recipes/accelerate/cpu_{ddp2,fsdp2,zero2,zero3}.yaml, 2 processes with half of it each. Fixed
completions make both sides train on the same tokens, so advantages, losses, parameter updates and
the logged global metrics must agree within float tolerance.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from dist_worker import SCENARIOS
from safetensors.torch import load_file
from trainer_helpers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
CONFIGS = ROOT / "recipes" / "accelerate"
LAUNCH_TIMEOUT = 300  # seconds; one launch takes ~20 s on 2 CPU cores
BACKENDS = {
    "ddp": "cpu_ddp2.yaml",
    "fsdp2": "cpu_fsdp2.yaml",
    "zero2": "cpu_zero2.yaml",
    "zero3": "cpu_zero3.yaml",
}
COMPARED = [
    "g4_dapo",
    "g4_grpo",
    "g8_dapo",
    "g8_grpo",
    "g8_dapo_adamw",
    "lora_g8_dapo",
    "lora_g4_grpo",
    "sync_ref",
    "save",
    "dynamic",
    "tools",
    "stream",
    "masks",
    "token_budget",
    "token_budget_grpo",
]
# token_budget: its rows dealt to processes by tokens (the first round's rows are compared as sets), and
# refused by DeepSpeed (a micro-step's policy pass cut into several backward passes; its engine takes
# one), so not launched under the zero backends.
TOKEN_BUDGET_SCENARIOS = ["token_budget", "token_budget_grpo"]
NONFINITE = ["nonfinite"]  # compared by its own test: the skipped step logs grad_norm nan or inf
SAMPLED = [
    "sampled",
    "uneven_stop",
    "lora_uneven_stop",
    "no_gather_uneven_stop",
]  # real sampling: compared between the 2-process backends only
# Metrics computed from tensors gathered over all processes: equal to the single-process values.
GLOBAL_METRICS = [
    "loss", "grad_norm", "learning_rate", "epoch", "reward", "reward/length_reward", "reward_std",
    "frac_reward_zero_std", "advantage/abs_mean", "advantage/min", "advantage/max",
    "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "reward_errors", "beta", "dynamic_sampling/extra_rounds",
    "dynamic_sampling/groups_dropped", "dynamic_sampling/groups_filled", "tools/call_frequency",
    "tools/failure_frequency", "tools/calls_per_episode", "tools/failed_calls_per_episode",
    "tools/turns_per_episode", "reward_std/group_mean",
    "rewards/length_reward/mean", "rewards/length_reward/std", "completions/mean_terminated_length",
    "completions/min_terminated_length", "completions/max_terminated_length", "num_tokens",
    "length_reward_mean", "policy_loss", "entropy_coef",
]  # fmt: skip
# Token means over every active token of the logging interval, on every process.
TOKEN_MEAN_METRICS = ["kl", "entropy", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region"]


def launch(output: Path, scenarios: list[str], config: str | None) -> None:
    """Run the worker on one process (config None) or under `accelerate launch --config_file config`."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(WORKER), str(output), *scenarios]
    if config is not None:
        command[1:1] = [
            "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
            "--main_process_port", str(free_port()), "--num_cpu_threads_per_process", "1",
        ]  # fmt: skip
    # A session of its own, so that a hang kills the launcher's workers too, not only the launcher.
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT)
        failure = f"exit {process.returncode}" if process.returncode else None
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        failure = f"timed out after {LAUNCH_TIMEOUT} s"
    (output / "stdout.txt").write_text(stdout)
    (output / "stderr.txt").write_text(stderr)
    if failure:
        done = [line for line in stdout.splitlines() if line.startswith("[dist_worker]")]
        pytest.fail(
            f"{failure}: {' '.join(command)}\nscenarios finished: {done}\n"
            f"--- stderr (whole in {output / 'stderr.txt'}) ---\n{stderr[-8000:]}"
        )


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("single")
    launch(output, COMPARED + NONFINITE, config=None)
    return output


def backend_runs(backend: str):
    """A module fixture: every compared and sampled scenario run on 2 processes of `backend`."""

    @pytest.fixture(scope="module")
    def runs(tmp_path_factory) -> Path:
        output = tmp_path_factory.mktemp(backend)
        scenarios = COMPARED + SAMPLED + NONFINITE
        if backend.startswith("zero"):
            scenarios = [name for name in scenarios if name not in TOKEN_BUDGET_SCENARIOS]
        launch(output, scenarios, BACKENDS[backend])
        return output

    return runs


ddp, fsdp2, zero2, zero3 = (backend_runs(name) for name in BACKENDS)


def load_run(folder: Path) -> dict:
    return {
        "initial": load_file(folder / "initial.safetensors"),
        "final": load_file(folder / "final.safetensors"),
        "log": json.loads((folder / "log_history.json").read_text()),
        "info": json.loads((folder / "run_info.json").read_text()),
        "first_round": torch.load(folder / "first_round.pt"),
    }


def assert_same_updates(one: dict, two: dict, rtol: float) -> None:
    """Same start, and the same update (final - initial) for every tensor, relative to its size."""
    assert one["final"].keys() == two["final"].keys()
    moved = 0
    for name in one["final"]:
        assert torch.equal(one["initial"][name], two["initial"][name]), f"{name}: different start"
        update_one = one["final"][name] - one["initial"][name]
        update_two = two["final"][name] - two["initial"][name]
        scale = update_one.abs().max().item()
        moved += scale > 0
        # final - initial is no finer than one float32 ulp of the weights: 1.2e-7 for a layer norm's
        # weights near 1, above rtol x an update of 1e-3
        ulp = torch.finfo(one["final"][name].dtype).eps * one["final"][name].abs().max().item()
        torch.testing.assert_close(
            update_two, update_one, rtol=rtol, atol=rtol * scale + ulp + 1e-9, msg=name
        )
    assert moved > 0, "no parameter moved: the comparison would be vacuous"


def assert_same_logs(one: list[dict], two: list[dict], keys: list[str]) -> None:
    assert len(one) == len(two)
    for step, (a, b) in enumerate(zip(one, two, strict=True)):
        for key in keys:
            assert (key in a) == (key in b), f"step {step}: {key} logged on one side only"
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), f"step {step}: {key}"


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("scenario", COMPARED)
def test_two_processes_match_one(request, single, backend, scenario):
    if backend.startswith("zero") and scenario in TOKEN_BUDGET_SCENARIOS:
        pytest.skip("DeepSpeed refuses it (tests/test_token_budget.py)")
    one = load_run(single / scenario)
    two = load_run(request.getfixturevalue(backend) / scenario)
    assert two["info"]["num_processes"] == 2
    # Same completions in the same global order: process r held the r-th slice of each batch (under
    # token_budget the processes deal the rows by tokens: the same ones, in another order).
    order = sorted if scenario in TOKEN_BUDGET_SCENARIOS else list
    assert order(two["first_round"]["completions"]) == order(one["first_round"]["completions"])
    advantages = [run["first_round"]["advantages"] for run in (two, one)]
    torch.testing.assert_close(
        *(a.sort().values if scenario in TOKEN_BUDGET_SCENARIOS else a for a in advantages)
    )
    assert two["first_round"]["dapo_normalizer"] == pytest.approx(one["first_round"]["dapo_normalizer"])
    # SGD: updates are lr x gradient, so 1e-4 checks gradients; Adam divides float noise in tiny
    # gradients by their own tiny size, so its updates get a looser bound.
    assert_same_updates(one, two, rtol=1e-3 if SCENARIOS[scenario].optim.startswith("adam") else 1e-4)
    assert_same_logs(one["log"], two["log"], GLOBAL_METRICS + TOKEN_MEAN_METRICS)


@pytest.mark.parametrize("plain, budgeted", [("g8_dapo", "token_budget"), ("g8_grpo", "token_budget_grpo")])
def test_token_budget_trains_as_the_micro_batch_passes(single, plain, budgeted):
    """Log-prob passes cut by tokens give the same updates, loss and KL (on 2 processes, with the rows
    dealt by tokens and as many passes on each, test_two_processes_match_one)."""
    plain, budgeted = load_run(single / plain), load_run(single / budgeted)
    assert_same_updates(plain, budgeted, rtol=1e-4)
    assert_same_logs(plain["log"], budgeted["log"], ["kl", "loss"])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_nonfinite_step_is_skipped_and_counted(request, single, backend):
    """Step 2 of 3 has infinite gradients: no backend applies it (same updates as the single
    process, whose guard drops the gradients), and every one counts it. Under DeepSpeed the step
    runs inside backward, where DeepSpeed skips it and the guard reads its overflow flag."""
    one = load_run(single / "nonfinite")
    two = load_run(request.getfixturevalue(backend) / "nonfinite")
    for run in (one, two):
        steps = [entry for entry in run["log"] if "loss" in entry]
        assert [entry.get("nonfinite_steps_skipped") for entry in steps] == [None, 1.0, None]
        assert all(torch.isfinite(value).all() for value in run["final"].values())
    assert_same_updates(one, two, rtol=1e-4)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_logged_metrics_are_global_means(request, backend):
    """The logged lengths are over both processes' completions, not the main process's own."""
    two = load_run(request.getfixturevalue(backend) / "g8_dapo")  # a group straddles the processes
    lengths = [len(c) for c in two["first_round"]["completions"]]  # global order, both processes
    half = len(lengths) // 2
    first = two["log"][0]
    assert first["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert first["completions/mean_length"] != pytest.approx(sum(lengths[:half]) / half)
    assert first["completions/max_length"] == max(lengths)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_dynamic_sampling_keeps_the_same_groups_on_two_processes(request, single, backend):
    """Both processes keep the groups one process keeps (test_two_processes_match_one compares the
    rest); here: extra rounds did happen, and no zero-spread group reached the first batch."""
    one = load_run(single / "dynamic")
    two = load_run(request.getfixturevalue(backend) / "dynamic")
    extra = [
        log["dynamic_sampling/extra_rounds"] for log in one["log"] if "dynamic_sampling/extra_rounds" in log
    ]
    assert extra == [log.get("dynamic_sampling/extra_rounds") for log in two["log"][: len(extra)]]
    assert sum(extra) > 0 and sum(log["dynamic_sampling/groups_dropped"] for log in one["log"][:-1]) > 0
    groups = two["first_round"]["advantages"].view(-1, 4)  # (groups, G)
    assert (groups != 0).any(dim=1).all()


def test_fsdp2_really_shards(fsdp2, ddp):
    """On CPUs accelerate silently turns an FSDP launch into DDP; dist_worker forces real FSDP2."""
    full = json.loads((fsdp2 / "g8_dapo" / "run_info.json").read_text())
    assert full == {
        "distributed_type": str(DistributedType.FSDP),
        "num_processes": 2,
        "policy_sharded": True,
        "reference_sharded": True,  # the frozen copy is sharded like the policy
    }
    lora = json.loads((fsdp2 / "lora_g8_dapo" / "run_info.json").read_text())
    assert lora["policy_sharded"] and lora["distributed_type"] == str(DistributedType.FSDP)
    plain = json.loads((ddp / "g8_dapo" / "run_info.json").read_text())
    assert plain["distributed_type"] == str(DistributedType.MULTI_CPU) and not plain["policy_sharded"]


def test_zero3_really_shards(zero3, zero2):
    """ZeRO-3 partitions the policy and the frozen reference; ZeRO-2 shards optimizer state only."""
    full = json.loads((zero3 / "g8_dapo" / "run_info.json").read_text())
    assert full == {
        "distributed_type": str(DistributedType.DEEPSPEED),
        "num_processes": 2,
        "policy_sharded": True,
        "reference_sharded": True,  # a DeepSpeed inference engine, partitioned like the policy
    }
    stage2 = json.loads((zero2 / "g8_dapo" / "run_info.json").read_text())
    assert stage2["distributed_type"] == str(DistributedType.DEEPSPEED) and not stage2["policy_sharded"]


def test_zero3_decodes_with_the_model_partitioned_when_asked(zero3):
    """ds3_gather_for_generation=False: ZeRO-3's per-module gathering hooks stay on while decoding
    (the whole-model gather takes them off); test_real_sampling_sharded_matches_ddp checks that the
    processes, which stop at different steps, still decode in step and train as DDP does."""
    gathered = json.loads((zero3 / "uneven_stop" / "run_info.json").read_text())
    partitioned = json.loads((zero3 / "no_gather_uneven_stop" / "run_info.json").read_text())
    assert gathered["hooked_modules_in_decoding"] == 0
    assert partitioned["hooked_modules_in_decoding"] > 0


@pytest.mark.parametrize("backend", ["fsdp2", "zero2", "zero3"])
@pytest.mark.parametrize("scenario", SAMPLED)
def test_real_sampling_sharded_matches_ddp(request, ddp, backend, scenario):
    """The real decode loop, with processes stopping at different steps under uneven_stop: sharded
    backends must neither deadlock nor mismatch collectives, and train exactly as DDP does."""
    plain, sharded = load_run(ddp / scenario), load_run(request.getfixturevalue(backend) / scenario)
    lengths = [len(c) for c in sharded["first_round"]["completions"]]
    if scenario.endswith("uneven_stop"):
        assert lengths[:4] == [1, 1, 1, 1] and max(lengths[4:]) > 1  # main process stopped first
    assert sharded["first_round"]["completions"] == plain["first_round"]["completions"]
    assert_same_updates(plain, sharded, rtol=1e-4)
    assert_same_logs(plain["log"], sharded["log"], GLOBAL_METRICS + TOKEN_MEAN_METRICS)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_checkpoint_written_once_by_main_process(request, backend):
    folder = request.getfixturevalue(backend) / "save"
    stderr = (folder.parent / "stderr.txt").read_text()
    assert "Traceback" not in stderr and "FileExistsError" not in stderr
    checkpoints = sorted(p.name for p in (folder / "train").iterdir() if p.name != "README.md")
    assert checkpoints == ["checkpoint-2"]  # beside the model card, written at each checkpoint (TRL's place)
    checkpoint = folder / "train" / "checkpoint-2"
    files = sorted(p.name for p in checkpoint.iterdir())
    assert {"model.safetensors", "trainer_state.json", "grpo_state.json", "scheduler.pt"} <= set(files)
    # One RNG state per process is the Trainer's design; everything else is written once.
    assert [f for f in files if f.startswith("rng_state")] == ["rng_state_0.pth", "rng_state_1.pth"]
    assert json.loads((checkpoint / "grpo_state.json").read_text())["beta"] == pytest.approx(0.04)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    saved = load_file(checkpoint / "model.safetensors")  # the whole model, gathered under FSDP
    final = load_file(folder / "final.safetensors")
    assert saved.keys() == final.keys()
    for name, value in final.items():
        torch.testing.assert_close(saved[name], value, msg=name)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_config_loads(path):
    """Every accelerate config parses and passes `accelerate launch`'s own checks."""
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1 and config.num_machines >= 1
    args, _, _ = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(path), "x.py"])
    )
    if config.distributed_type == DistributedType.FSDP:
        assert args.use_fsdp and int(config.fsdp_config["fsdp_version"]) == 2
    if config.distributed_type == DistributedType.DEEPSPEED:
        assert args.use_deepspeed and config.deepspeed_config["zero_stage"] in (2, 3)
    if config.distributed_type == DistributedType.MULTI_GPU:
        assert args.multi_gpu  # the torchrun launcher; MULTI_CPU would need mpirun
