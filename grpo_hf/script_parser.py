"""`TrlParser`: TRL 1.16's `HfArgumentParser` with `--config file.yaml`, and errors a person can read.

The file's values become the defaults, flags on the command line override them, and its `env:`
mapping is put into `os.environ` before anything is parsed. As in TRL, a `T | None` setting of a
type other than str takes `none` / `null` on the command line (transformers' parser refuses it).
A `bool | None` setting also takes `--no_<name>` (False), as a `bool` defaulting to True does: TRL's
`gradient_checkpointing` defaults to True and so has `--no_gradient_checkpointing`, grpo-hf's is None
until resolved (so that transformers' newer name, activation_checkpointing, can set it).

Departures from TRL, each an earlier or clearer answer:
- unknown keys in the YAML file are reported before the command line is parsed, and `--config=path`
  is read like `--config path`; a missing file names the YAML files beside where it was looked for;
- a mistake is one line (`prog: error: ...`), not argparse's usage block of every flag, and an
  unknown flag is named with the closest valid ones;
- `--help` lists the settings by section, one line each, and `--help SECTION` one section in full
  (`script_help`);
- a settings class may declare `_SETTINGS_DECIDED_TOGETHER`, groups of settings that decide one
  thing (GRPOConfig: precision, bf16, fp16): when the command line gives one of a group, the file's
  values for the others are dropped, so that the flag means what it says (`--bf16 false` against
  the file's `precision: auto`).
"""

import argparse
import dataclasses
import difflib
import enum
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml
from transformers import HfArgumentParser

from grpo_hf.script_help import SectionHelpAction, close_flags, unknown_flags_message

logger = logging.getLogger(__name__)

USAGE = "%(prog)s [--config FILE.yaml] [--help [SECTION]] [--SETTING VALUE ...]"


class TrlParser(HfArgumentParser):
    """`HfArgumentParser` that also reads `--config file.yaml` (see the module docstring).

        parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
        script_args, training_args, model_args = parser.parse_args_and_config()

    A field named `config` is refused: `--config` is the file.
    """

    def __init__(self, dataclass_types=None, **kwargs):
        if dataclass_types is None:
            dataclass_types = []
        elif dataclasses.is_dataclass(dataclass_types) or not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        dataclass_types = list(dataclass_types)  # a generator would be spent by the check below
        for dataclass_type in dataclass_types:
            if "config" in {f.name for f in dataclasses.fields(dataclass_type)}:
                raise ValueError(
                    f"{dataclass_type.__name__} has a field named 'config', which TrlParser reserves for the "
                    "--config file; rename the field."
                )
        add_help = kwargs.pop("add_help", True)
        kwargs.setdefault("usage", USAGE)
        super().__init__(dataclass_types=dataclass_types, add_help=False, **kwargs)
        if add_help:
            self.add_argument("-h", "--help", action=SectionHelpAction)
        self._accept_none()
        self._add_negations()

    def error(self, message: str) -> typing.NoReturn:
        """Exit with one line, not argparse's usage block (which lists every flag)."""
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the settings)\n")

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ) -> tuple:
        """One instance per dataclass: the YAML file's values, overridden by the command line.

        `args` defaults to `sys.argv[1:]`. Keys of the file that no dataclass has are an error with
        `fail_with_unknown_args`; with `return_remaining_strings` they come back as
        `['--key', 'value', ...]` after the dataclasses, joined with the command line's leftovers, or
        as two lists (file's, command line's) with `separate_remaining_strings`. Without it, a flag
        no dataclass has is a ValueError naming the closest valid flags.
        """
        args = list(sys.argv[1:] if args is None else args)
        config_path, args = _pop_config_flag(args)
        from_file = []
        if config_path:
            config = self._without_replaced_settings(read_config(config_path), args, config_path)
            from_file = self.set_defaults_with_config(**config)
        if from_file and fail_with_unknown_args and not return_remaining_strings:
            raise ValueError(
                f"Unknown settings in {config_path}: {from_file[::2]}{_suggestions(self, from_file[::2])}; "
                "remove them, or parse with fail_with_unknown_args=False."
            )
        *parsed, from_command_line = self.parse_args_into_dataclasses(
            args=args, return_remaining_strings=True
        )
        if not return_remaining_strings:
            if from_command_line:
                raise ValueError(unknown_flags_message(from_command_line, self))
            return tuple(parsed)
        if separate_remaining_strings:
            return (*parsed, from_file, from_command_line)
        return (*parsed, from_file + from_command_line)

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        """Make `kwargs` the defaults of the arguments they name (also in subparsers), no longer
        required; returns the others as `['--key', 'value', ...]`."""
        used = _apply_defaults(self, kwargs)
        return [item for key, value in kwargs.items() if key not in used for item in (f"--{key}", str(value))]

    def given_on_command_line(self, args: list[str]) -> set[str]:
        """The settings (dataclass field names) that `args` gives, whatever the defaults."""
        saved = [(action, action.default, action.required) for action in self._actions]
        for action in self._actions:
            action.default, action.required = argparse.SUPPRESS, False
        try:
            namespace, _ = self.parse_known_args(args)
        finally:
            for action, default, required in saved:
                action.default, action.required = default, required
        return set(vars(namespace))

    def _without_replaced_settings(self, config: dict, args: list[str], config_path: str) -> dict:
        """The file's settings less those a flag of their `_SETTINGS_DECIDED_TOGETHER` group replaces."""
        groups = [set(g) for t in self.dataclass_types for g in getattr(t, "_SETTINGS_DECIDED_TOGETHER", ())]
        groups = [group for group in groups if group & set(config)]
        if not groups or any(arg == "-h" or arg.startswith("--help") for arg in args):
            return config
        given = self.given_on_command_line(args)
        dropped = {name for group in groups if group & given for name in group - given if name in config}
        for name in sorted(dropped):
            logger.info(
                "%s=%r from %s is dropped: the command line sets what it decides.",
                name,
                config[name],
                config_path,
            )
        return {key: value for key, value in config.items() if key not in dropped}

    def _accept_none(self) -> None:
        """`none` / `null` for a `T | None` flag whose T is a number or another non-str scalar, as in TRL."""
        hints = {}
        for dataclass_type in self.dataclass_types:
            hints |= typing.get_type_hints(dataclass_type)
        for action in self._actions:
            if action.type is not None and _optional_scalar(hints.get(action.dest)):
                action.type = _none_or(action.type)

    def _add_negations(self) -> None:
        """`--no_<name>` for each `bool | None` setting that has none (see the module docstring)."""
        hints = {}
        for dataclass_type in self.dataclass_types:
            hints |= typing.get_type_hints(dataclass_type)
        flags = {option for action in self._actions for option in action.option_strings}
        for name, hint in hints.items():
            if hint == bool | None and f"--no_{name}" not in flags and f"--{name}" in flags:
                self.add_argument(
                    f"--no_{name}",
                    f"--no-{name.replace('_', '-')}",
                    action="store_false",
                    dest=name,
                    default=argparse.SUPPRESS,
                    help=f"Set {name} to False.",
                )


def _optional_scalar(hint: object) -> bool:
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return False
    others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if len(typing.get_args(hint)) != 2 or len(others) != 1:
        return False
    (inner,) = others
    enum_type = isinstance(inner, type) and issubclass(inner, enum.Enum)
    return inner not in (str, bool) and typing.get_origin(inner) is None and not enum_type


def _none_or(convert: Callable[[str], object]) -> Callable[[str], object]:
    def parse(value: str) -> object:
        return None if value.lower() in ("none", "null") else convert(value)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its errors
    return parse


def read_config(path: str) -> dict:
    """A `--config` YAML file as a mapping, after putting its `env:` mapping into `os.environ`."""
    if not Path(path).is_file():
        raise FileNotFoundError(_missing_config_message(path))
    with open(path) as file:
        config = yaml.safe_load(file)
    if not isinstance(config, dict):
        raise ValueError(f"Config file {path} must contain a YAML mapping (setting: value lines).")
    env = config.pop("env", {})
    if not isinstance(env, dict):
        raise ValueError(f"`env` in {path} must be a mapping of environment variables to values.")
    for name, value in env.items():
        os.environ[name] = str(value)
    return config


def _missing_config_message(path: str) -> str:
    """What exists where the file was looked for: the YAML files of its folder, or those up to two
    folders below the nearest folder above it that exists, the closest names first."""
    folder = Path(path).parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    depth = ("*.y*ml",) if folder == Path(path).parent else ("*.y*ml", "*/*.y*ml", "*/*/*.y*ml")
    names = sorted(str(found) for pattern in depth for found in folder.glob(pattern))
    if not names:
        return f"--config {path}: no such file, and no YAML file in {folder}/."
    close = difflib.get_close_matches(path, names, n=len(names), cutoff=0.0)[:12]
    more = f" and {len(names) - len(close)} more" if len(names) > len(close) else ""
    return f"--config {path}: no such file; YAML files in {folder}/, the closest first: {', '.join(close)}{more}."


def _suggestions(parser: argparse.ArgumentParser, flags: list[str]) -> str:
    close = {flag: close_flags(flag, parser) for flag in flags}
    said = [
        f"{flag[2:]}: did you mean {' or '.join(c[2:] for c in near)}?"
        for flag, near in close.items()
        if near
    ]
    return f" ({'; '.join(said)})" if said else ""


def _pop_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    """The `--config` path (`--config path` or `--config=path`) and the arguments without it."""
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1], args[:i] + args[i + 1 :]
        if arg == "--config":
            if i + 1 == len(args):
                raise ValueError("--config needs the path of a YAML file.")
            return args[i + 1], args[:i] + args[i + 2 :]
    return None, args


def _apply_defaults(parser: argparse.ArgumentParser, values: dict) -> set[str]:
    used = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                used |= _apply_defaults(subparser, values)
        elif action.dest in values:
            action.default, action.required = values[action.dest], False
            used.add(action.dest)
    return used
