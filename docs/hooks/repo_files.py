"""MkDocs hook: a page that is a file of the repository's root (CONTRIBUTING.md, CHANGELOG.md).

A page holding `<!-- repo-file NAME -->` shows that file, its links rebased from the repository root to
`docs/` (`docs/testing.md` becomes `testing.md`), so one file reads right on GitHub and on the site.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- repo-file (\S+) -->")
LINK = re.compile(r"\]\(docs/")


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs event: put the named file where the page has the marker."""
    return MARKER.sub(lambda match: rebased((ROOT / match[1]).read_text()), markdown)


def rebased(text: str) -> str:
    """Links into docs/ made relative to docs/ itself."""
    return LINK.sub("](", text)
