"""How `trl grpo` and `grpo-hf grpo` parse one command line: the value each flag given ends up as.

    python bench/trl_cli_parse.py --side trl -- --dataset_name my.jsonl --reward_funcs accuracy_reward ...
    python bench/trl_cli_parse.py --side ours -- <the same words>

`--side trl` needs TRL 1.16 (an environment of its own: `python3 -m venv /work/venv-trl &&
/work/venv-trl/bin/pip install torch==2.13.0 trl==1.16.0`) and imports nothing of grpo-hf; `--side
ours` needs grpo-hf. Each parses the words with its script's parser (TRL's `trl.scripts.grpo.make_parser`,
ours `grpo_hf_cli.grpo.make_parser`) as its console command does, with the words no dataclass takes
handed back (they go to `accelerate launch`), and prints one JSON object: `values`, the settings the
words (and the --config file) give, each as the parsed dataclasses hold it after their checks; `from_file` and
`from_command_line`, the words handed back; or `error`, the parser's refusal. tests/test_trl_cli.py
compares the two sides.
"""

import argparse
import dataclasses
import json
import sys

import yaml


def given_settings(parser: argparse.ArgumentParser, words: list[str]) -> set[str]:
    """The settings `words` give, on the command line or as keys of the --config file."""
    words, from_file = list(words), set()
    if "--config" in words:  # TrlParser's own flag, not an argparse one
        i = words.index("--config")
        with open(words[i + 1]) as file:
            from_file = set(yaml.safe_load(file)) - {"env"}
        del words[i : i + 2]
    saved = [(action, action.default, action.required) for action in parser._actions]
    for action in parser._actions:
        action.default, action.required = argparse.SUPPRESS, False
    try:
        namespace, _ = parser.parse_known_args(words)
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required
    return set(vars(namespace)) | from_file


def parse(side: str, words: list[str]) -> dict:
    """The JSON report of one side (see the module docstring)."""
    if side == "trl":
        from trl.scripts.grpo import make_parser
    else:
        from grpo_hf_cli.grpo import make_parser
    parser = make_parser(prog=f"{side} grpo")
    given = given_settings(parser, words)
    try:
        *parsed, from_file, from_command_line = parser.parse_args_and_config(
            words, return_remaining_strings=True, separate_remaining_strings=True
        )
    except (ValueError, OSError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    values = {}
    for instance in parsed:
        for field in dataclasses.fields(instance):
            if field.name in given:
                values[field.name] = _plain(getattr(instance, field.name))
    return {"values": values, "from_file": from_file, "from_command_line": from_command_line}


def _plain(value: object) -> object:
    """A JSON value: enums by their value, dataclasses as dicts, the rest as text where JSON has none."""
    if hasattr(value, "value") and not isinstance(value, int | float | str):
        return value.value
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str | dict):
        return value
    return str(value)


if __name__ == "__main__":
    cut = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--side", choices=("trl", "ours"), required=True)
    args = options.parse_args(sys.argv[1:cut])
    print(json.dumps(parse(args.side, sys.argv[cut + 1 :])))
