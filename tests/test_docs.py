"""The documentation holds: every Python block of README.md and docs/ runs as written, every relative
link resolves, and the GRPOConfig reference lists every setting with the help `--help` prints.

A block whose info string marks it `notest` (```` ```python {.notest} ````: pytest-markdown-docs' word
as a class attribute, which GitHub and MkDocs' superfences both read; a bare `python notest` breaks the
site's rendering of the block) is shown, not run: it needs a GPU, a vLLM server, a Hub model or a
dataset of yours. Every other block runs alone in a subprocess, in a fresh folder, wandb disabled; the README's quick start trains
the real embedded model for two steps, the docs' examples a tiny random model.
"""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_hf import GRPOConfig

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON = {"python", "py", "python3"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$")


@dataclasses.dataclass
class Block:
    """A fenced code block: its file, first line, info-string words and code."""

    path: Path
    line: int
    info: list[str]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, its code dedented by the fence's indentation."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a code block that is never closed")
        code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end])
        blocks.append(Block(path, i + 1, opening["info"].split(), code + "\n"))
        i = end + 1
    return blocks


def runnable(block: Block) -> bool:
    marks = {word.strip("{}.") for word in block.info[1:]}
    return bool(block.info) and block.info[0] in PYTHON and "notest" not in marks


RUNNABLE = [block for path in DOCUMENTS for block in fenced_blocks(path) if runnable(block)]

# What a block must also leave behind or print, beyond running without an error.
EXPECTED = {
    "README.md": [
        lambda out, stdout: (out / "outputs" / "quickstart" / "adapter_model.safetensors").is_file(),
        lambda out, stdout: "'reward/ends_with_answer'" in stdout,  # the user's reward, under its name
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[block.id for block in RUNNABLE])
def test_python_block_runs(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block.code)
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{block.id}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    for check in EXPECTED.get(str(block.path.relative_to(ROOT)), []):
        assert check(tmp_path, done.stdout), f"{block.id}: {done.stdout[-3000:]}"


def test_the_quick_start_and_the_docs_examples_are_collected():
    names = {block.path.name for block in RUNNABLE}
    assert {"README.md", "grpo-trainer.md", "tools-and-environments.md"} <= names
    readme = [block for block in RUNNABLE if block.path.name == "README.md"]
    assert len(readme) == 1, "the README runs one example, its quick start (the real model, two steps)"


ATTRIBUTES = re.compile(r'(\{[^}]*\}|\w+="[^"]*")(\s+(\{[^}]*\}|\w+="[^"]*"))*')


def renders_on_the_site(block: Block) -> bool:
    """superfences takes a language then `{.class}` attributes or `key="value"` options, nothing else:
    any other word turns the block into a paragraph of text."""
    rest = " ".join(block.info[1:])
    return not rest or bool(ATTRIBUTES.fullmatch(rest))


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_every_code_block_renders_on_the_site(path):
    assert [block.id for block in fenced_blocks(path) if not renders_on_the_site(block)] == []


def test_fenced_blocks_reads_info_strings_and_indented_fences(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n- item\n\n  ```python {.notest}\n  y = 2\n  ```\n```bash\nls\n```\n"
    )
    blocks = fenced_blocks(page)
    assert [(b.line, b.info, b.code) for b in blocks] == [
        (2, ["python"], "x = 1\n"),
        (7, ["python", "{.notest}"], "y = 2\n"),
        (10, ["bash"], "ls\n"),
    ]
    assert [runnable(b) for b in blocks] == [True, False, False]
    assert [renders_on_the_site(b) for b in blocks] == [True, True, True]
    assert not renders_on_the_site(Block(page, 1, ["python", "notest"], ""))


# ---- Relative links -----------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def without_blocks(path: Path) -> str:
    """The file's text without its fenced code blocks (whose lines are neither links nor headings)."""
    text = path.read_text()
    for block in fenced_blocks(path):
        text = text.replace(block.code.rstrip("\n"), "")
    return text


def prose(path: Path) -> str:
    """The file's text without code blocks and inline code, where a bracket is not a link."""
    return re.sub(r"`[^`\n]*`", "", without_blocks(path))


def anchors(path: Path) -> set[str]:
    """A Markdown file's heading anchors, as GitHub and MkDocs (Python-Markdown's toc) make them."""
    found = set()
    for title in HEADING.findall(without_blocks(path)):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "").lower()
        github = re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")
        mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", plain).strip())
        found |= {github, mkdocs}
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no such heading)")
    return broken


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Batch sizes: `completions`, not prompts\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#batch-sizes-completions-not-prompts) [web](https://x.org/a.md)\n"
        "[gone](missing.md) [bad anchor](other.md#nothing) `[code](not-a-link.md)`\n"
        "```bash\necho [x](inside-code.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md (no such file)", "other.md#nothing (no such heading)"]


# ---- The GRPOConfig reference ---------------------------------------------------------------------


def config_reference_hook():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs/hooks/config_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_the_config_reference_lists_every_setting_with_its_help():
    hook = config_reference_hook()
    page = (ROOT / "docs/reference/grpo-config.md").read_text()
    assert hook.MARKER in page
    rendered = hook.on_page_markdown(page, None, None, None)
    rows = {
        line.split(" | ")[0].strip("| `"): line for line in rendered.splitlines() if line.startswith("| `")
    }
    for field in dataclasses.fields(GRPOConfig):
        help_text = " ".join(field.metadata["help"].split())
        assert field.name in rows, field.name
        assert hook._cell(help_text) in rows[field.name], field.name


def test_the_config_reference_groups_by_declaring_class_and_keeps_cells_whole():
    hook = config_reference_hook()
    from transformers import TrainingArguments

    from grpo_hf.config.loss_args import LossArguments

    assert hook.declaring_class(GRPOConfig, "beta") is LossArguments
    assert hook.declaring_class(GRPOConfig, "precision") is GRPOConfig
    # A TrainingArguments field whose default GRPOConfig overrides stays there, as --help groups it.
    assert hook.declaring_class(GRPOConfig, "learning_rate") is TrainingArguments
    assert hook._cell("a | b\n  <output_dir>") == "a \\| b &lt;output_dir&gt;"
