"""`--help` by section, and one-line answers to a mistaken flag, for `TrlParser` (`script_args`).

A flag's section is the dataclass that first declared its field: each settings class names itself
in a `_help_section = (key, title)` class attribute (a class without one is named after itself),
so that a field added to `loss_args.LossArguments` is listed under `loss` with nothing else to edit,
and a TrainingArguments field whose default `GRPOConfig` overrides stays under `training`.

`--help` prints each section with one line per flag (its help's first sentence), a section of more
than `FULL_LISTING_LIMIT` flags (transformers' TrainingArguments) as its flag names only;
`--help SECTION` prints that section's flags with their whole help and defaults, `--help all` every
section so. An unknown flag is answered with the closest valid ones (difflib), on one line.
"""

import argparse
import dataclasses
import difflib
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass

FULL_LISTING_LIMIT = 40
# A sentence ends at a full stop followed by a capital or an opening bracket, but not after an
# abbreviation ("e.g. MoE", "Dr. GRPO") or before a quote ("e.g. 'sdpa'").
_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!\bDr)(?<!\bvs)\.\s+(?=[A-Z(])")


@dataclass
class Section:
    """The flags of one section, in the order the parser declares them."""

    key: str
    title: str
    actions: list[argparse.Action]


def sections(parser: argparse.ArgumentParser, dataclass_types: list[type]) -> list[Section]:
    """The parser's flags by the section of the dataclass that declared each field: the others,
    then the GRPO sections, then the ones too long to list in full; by first appearance within."""
    of_field = {}
    for dtype in dataclass_types:
        for field in dataclasses.fields(dtype):
            of_field.setdefault(field.name, section_of(declaring_class(dtype, field.name)))
    found: dict[str, Section] = {}
    for action in parser._actions:
        if isinstance(action, SectionHelpAction) or action.help == argparse.SUPPRESS:
            continue
        key, title = of_field.get(action.dest, ("other", "other settings"))
        found.setdefault(key, Section(key, title, [])).actions.append(action)
    order = list(found.values())
    return sorted(order, key=lambda s: (len(s.actions) > FULL_LISTING_LIMIT, s.title.startswith("GRPO")))


def declaring_class(dtype: type, name: str) -> type:
    """The first class in the MRO, from the base up, whose own annotations declare the field `name`:
    the section it belongs to in `--help` and in the docs' GRPOConfig reference."""
    return next(c for c in reversed(dtype.__mro__) if name in c.__dict__.get("__annotations__", {}))


def section_of(declaring: type) -> tuple[str, str]:
    """(key, title) of a declaring class's section: its `_help_section`, else one from its name."""
    section = declaring.__dict__.get("_help_section")
    if section is not None:
        return section
    key = re.sub(r"(Arguments|Args|Config)$", "", declaring.__name__).lower() or declaring.__name__.lower()
    return key, f"{declaring.__module__.split('.')[0]}.{declaring.__name__}"


def overview(parser: argparse.ArgumentParser, dataclass_types: list[type]) -> str:
    """`--help`: the usage, then every section, one line per flag (or the flag names alone)."""
    width = _width()
    found = sections(parser, dataclass_types)
    keys = ", ".join(section.key for section in found)
    lines = [parser.format_usage().rstrip(), ""]
    if parser.description:
        lines += [textwrap.fill(parser.description, width), ""]
    lines += [
        textwrap.fill(
            f"`--help SECTION` shows a section's settings in full ({keys}); `--help all`: every one.", width
        )
    ]
    for section in found:
        lines += ["", f"{section.title} (--help {section.key}):"]
        names = [action.option_strings[0] for action in _distinct(section.actions)]
        if len(section.actions) > FULL_LISTING_LIMIT:
            lines += textwrap.wrap(", ".join(names), width, initial_indent="  ", subsequent_indent="  ")
            continue
        column = min(max(map(len, names)), 34) + 4
        for name, action in zip(names, _distinct(section.actions), strict=True):
            head = f"  {name}".ljust(column - 2) + "  "
            lines.append(_one_line(head, first_sentence(action.help or ""), width))
    return "\n".join(lines) + "\n"


def section_help(parser: argparse.ArgumentParser, dataclass_types: list[type], keys: list[str]) -> str:
    """`--help SECTION` / `--help all`: the sections' flags with argparse's whole help and defaults."""
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    for section in sections(parser, dataclass_types):
        if section.key in keys:
            formatter.start_section(section.title)
            formatter.add_arguments(section.actions)
            formatter.end_section()
    return formatter.format_help()


def first_sentence(text: str) -> str:
    """The help text's first sentence, on one line."""
    text = " ".join(text.split())
    return _SENTENCE_END.split(text, maxsplit=1)[0].rstrip(".")


def _one_line(head: str, text: str, width: int) -> str:
    room = width - len(head)
    return head + (text if len(text) <= room else text[: max(room - 1, 0)].rstrip() + "…")


def _distinct(actions: list[argparse.Action]) -> list[argparse.Action]:
    """One action per setting: a boolean's `--no_x` complement is listed with `--x`, not apart."""
    seen, kept = set(), []
    for action in actions:
        if action.dest not in seen:
            seen.add(action.dest)
            kept.append(action)
    return kept


def _width() -> int:
    return max(80, min(shutil.get_terminal_size((110, 24)).columns, 140))


class SectionHelpAction(argparse.Action):
    """`-h` / `--help [SECTION]`: print the overview, or the sections named, and exit."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs):
        kwargs.setdefault("help", "Show the settings by section; SECTION (or 'all') shows them in full.")
        super().__init__(
            option_strings, dest, nargs="?", default=argparse.SUPPRESS, metavar="SECTION", **kwargs
        )

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        types = parser.dataclass_types
        if values is None:
            parser._print_message(overview(parser, types), sys.stdout)
            parser.exit()
        keys = [section.key for section in sections(parser, types)]
        if values != "all" and values not in keys:
            parser.error(f"--help {values}: no such section; the sections are {', '.join(keys)} (or all)")
        parser._print_message(section_help(parser, types, keys if values == "all" else [values]), sys.stdout)
        parser.exit()


def close_flags(flag: str, *parsers: argparse.ArgumentParser) -> list[str]:
    """The flags of `parsers` closest to `flag` (a mistyped `--name`), best first; none if none is close."""
    known = [
        action.option_strings[0] for parser in parsers for action in parser._actions if action.option_strings
    ]
    typed = "--" + flag.lstrip("-").replace("-", "_")
    return difflib.get_close_matches(typed, known, n=3, cutoff=0.6)


def unknown_flags_message(leftovers: list[str], *parsers: argparse.ArgumentParser) -> str:
    """One line about the command-line words no setting took, naming the closest flags of `parsers`."""
    parts = []
    for word in leftovers:
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            close = close_flags(flag, *parsers)
            parts.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
    if not parts:
        return f"unexpected values {leftovers} (each setting is given as --name value)"
    return f"unknown setting{'s' * (len(parts) > 1)} {', '.join(parts)}"
