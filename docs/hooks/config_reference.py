"""MkDocs hook: the GRPOConfig reference page, generated from the fields' help metadata.

`docs/reference/grpo-config.md` holds the line `<!-- grpo-config-fields -->`; at build time it is
replaced by one table per section, made from `dataclasses.fields(GRPOConfig)`: the help text that
`--help` prints, the default and the type. A field's section is the dataclass that first declared
it, as `--help` groups flags (a class's `_help_section` title where it has one, else its name): a
TrainingArguments field whose default GRPOConfig overrides stays under TrainingArguments, with
GRPOConfig's default and help. Nothing is written by hand, so the page and `--help` cannot drift.
"""

import dataclasses
import html
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the checkout's grpo_hf, also where it is not installed
from grpo_hf.script_help import declaring_class, section_of  # noqa: E402 (the rule --help groups by)

MARKER = "<!-- grpo-config-fields -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs event: put the generated tables where the page has the marker."""
    if MARKER not in markdown:
        return markdown
    from grpo_hf import GRPOConfig

    return markdown.replace(MARKER, config_reference(GRPOConfig))


def config_reference(config_class: type) -> str:
    """Markdown tables of every field of `config_class`, by the section that declared it: its own
    sections first (in declaration order), the big inherited ones (TrainingArguments) last."""
    sections: dict[type, list[dataclasses.Field]] = {}
    for field in dataclasses.fields(config_class):
        sections.setdefault(declaring_class(config_class, field.name), []).append(field)
    ordered = sorted(sections.items(), key=lambda item: item[0].__module__.startswith("transformers"))
    return "\n".join(_section(owner, fields) for owner, fields in ordered)


def _section(owner: type, fields: list[dataclasses.Field]) -> str:
    doc = ""
    if owner.__module__.startswith("grpo_hf"):  # the section module's first paragraph says what it holds
        doc = (sys.modules[owner.__module__].__doc__ or "").strip().split("\n\n")[0]
    rows = [
        f"| `{f.name}` | {_type(f)} | {_default(f)} | {_cell(f.metadata.get('help', ''))} |" for f in fields
    ]
    table = ["| setting | type | default | what it does |", "| --- | --- | --- | --- |", *rows]
    declared = f"Declared in `{owner.__module__}.{owner.__name__}`."
    return "\n".join([f"## {section_of(owner)[1]}", "", declared, " ".join(doc.split()), "", *table, ""])


def _type(field: dataclasses.Field) -> str:
    # Plain text, not code: a table cell's escaped pipe would show as "\|" inside a code span.
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    return _cell(str(kind).replace("typing.", ""))


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    return _cell(f"`{value!r}`" if "|" not in repr(value) else repr(value))


def _cell(text: str) -> str:
    """Text that stays inside one table cell: one line, pipes escaped, angle brackets shown."""
    return html.escape(" ".join(str(text).split()), quote=False).replace("|", "\\|")
