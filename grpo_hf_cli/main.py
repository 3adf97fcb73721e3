"""The `grpo-hf` console script: `grpo-hf grpo ...` (TRL's `trl grpo`) and `grpo-hf env` (`trl env`)."""

import argparse
import sys

import grpo_hf
from grpo_hf_cli.env import print_env
from grpo_hf_cli.launch import launch

COMMANDS = {
    "grpo": "Train with GRPO: TRL's `trl grpo` arguments, or a built-in --task (`grpo-hf grpo --help`).",
    "env": "Print the versions, CPU, precision and GPUs for a bug report.",
}


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (else `sys.argv[1:]`) names; its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="grpo-hf", description="grpo-hf: GRPO on the Hugging Face stack.")
    parser.add_argument("--version", action="version", version=f"grpo-hf {grpo_hf.__version__}")
    commands = parser.add_subparsers(dest="command", title="commands")
    # The grpo command's own parser reads its arguments (and its --help).
    commands.add_parser("grpo", help=COMMANDS["grpo"], add_help=False)
    commands.add_parser("env", help=COMMANDS["env"])
    args, rest = parser.parse_known_args(argv)
    if args.command == "grpo":
        return launch(argv[argv.index("grpo") + 1 :])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "env":
        print_env()
        return 0
    parser.print_help()
    return 0
