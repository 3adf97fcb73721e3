"""How `grpo-hf grpo` runs the GRPO script: through `accelerate launch`, as `trl grpo` does.

The command line is parsed here first, whole (the settings' checks included), so that a mistake
stops in one line before any process starts. What no dataclass takes must be `accelerate launch`'s,
on the command line or as keys of the --config file as in TRL (`--num_processes 2`, `--multi_gpu`,
`--config_file FILE`, `--mixed_precision`, `--main_process_port`...); anything else is refused,
naming the closest flags of both. TRL's `--accelerate_config FILE` is `--config_file FILE`; TRL's
named configs (zero2, fsdp2, ...) ship inside TRL's package and not here: name a file (the
repository's recipes/accelerate/ holds CPU and GPU ones).

Then `python -m accelerate.commands.launch [those flags] -m grpo_hf_cli.grpo [the rest]` runs as a
child process, whose exit status is the command's. Without launch flags accelerate's defaults apply,
as for `trl grpo`: the default accelerate config file (`accelerate config`) if there is one, else
one process per CUDA GPU (one process without a GPU).
"""

import os
import subprocess
import sys
from pathlib import Path

from accelerate.commands.launch import launch_command_parser

from grpo_hf.script_help import unknown_flags_message
from grpo_hf_cli.grpo import LAUNCHED_BY_CLI, check_settings, make_parser

PROG = "grpo-hf grpo"


def launch(argv: list[str]) -> int:
    """Check `argv` (a `trl grpo` command line without `trl grpo`), then train through accelerate launch."""
    parser = make_parser(prog=PROG)
    try:
        *parsed, from_file, from_command_line = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
        check_settings(*parsed)
        launch_args = accelerate_arguments(from_file, from_command_line)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launch_args,
        "-m",
        "grpo_hf_cli.grpo",
        *_without(argv, from_command_line),
    ]
    return subprocess.run(command, env={**os.environ, LAUNCHED_BY_CLI: "1"}).returncode


def accelerate_arguments(from_file: list[str], from_command_line: list[str]) -> list[str]:
    """`accelerate launch`'s flags among the words no setting took (`--key value` pairs from the file,
    then the command line's), checked by accelerate's own parser; a ValueError for anything else."""
    launcher = launch_command_parser()
    actions = {option: action for action in launcher._actions for option in action.option_strings}
    words = _from_file(from_file, actions) + from_command_line
    words = _config_file(words)
    if unknown := [word for word in words if word.startswith("-") and word.split("=", 1)[0] not in actions]:
        said = unknown_flags_message(unknown, make_parser(prog=PROG), launcher)
        raise ValueError(f"{said}: neither a grpo-hf setting nor an accelerate launch flag")

    def one_line(message: str) -> None:
        raise ValueError(f"accelerate launch: {message}")

    launcher.error = one_line  # its values are checked here too, before anything starts
    launcher.parse_args([*words, "-m", "grpo_hf_cli.grpo"])
    return words


def _from_file(pairs: list[str], actions: dict) -> list[str]:
    """The file's `['--key', 'value']` pairs as accelerate takes them: a switch alone when true."""
    words = []
    for flag, value in zip(pairs[::2], pairs[1::2], strict=True):
        switch = flag in actions and actions[flag].nargs == 0
        if not switch:
            words += [flag, value]
        elif value == "True":
            words.append(flag)
    return words


def _config_file(words: list[str]) -> list[str]:
    """TRL's `--accelerate_config FILE` as accelerate's `--config_file FILE`."""
    if "--accelerate_config" not in words:
        return words
    i = words.index("--accelerate_config")
    if i + 1 == len(words) or not Path(words[i + 1]).is_file():
        name = words[i + 1] if i + 1 < len(words) else ""
        raise ValueError(
            f"--accelerate_config {name}: no such file. grpo-hf ships no named accelerate configs (TRL's zero2, "
            "fsdp2, ... are files of TRL's package): give a file, e.g. recipes/accelerate/zero2.yaml of the "
            "repository, or write one with `accelerate config`."
        )
    return [*words[:i], "--config_file", words[i + 1], *words[i + 2 :]]


def _without(words: list[str], taken: list[str]) -> list[str]:
    """`words` less `taken`, an ordered subsequence of it."""
    kept, rest = [], iter(taken)
    expected = next(rest, None)
    for word in words:
        if expected is not None and word == expected:
            expected = next(rest, None)
        else:
            kept.append(word)
    return kept
