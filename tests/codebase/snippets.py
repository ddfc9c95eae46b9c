"""The Python snippets of README.md, CONTRIBUTING.md and docs/, read from their Markdown.

A page's ```python blocks run in order, as one script (a page is one session, as a reader would
paste it). Directives are HTML comments, invisible on the rendered page:

- `<!-- setup` ... `-->` and `<!-- check` ... `-->`: code run where it stands, unseen on the page
  (inputs at small shapes before a block; assertions on what a block printed after it).
- `<!-- mirrored by: tests/path.py::test_name -->` just before a block: the block is not run here;
  the named test runs it (its source names this page), because it needs what a snippet cannot set
  up (a framework's trainer, a package that does not install beside torch 2.13).
- `<!-- ranks: N -->` anywhere on a page: its script runs on N ranks under `torchrun`
  (gloo on this machine, one thread each), as a reader would launch it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^```(\w*)\s*$")
_MIRRORED = re.compile(r"^<!--\s*mirrored by:\s*(\S+?)::(\w+)\s*-->\s*$")
_RANKS = re.compile(r"^<!--\s*ranks:\s*(\d+)\s*-->\s*$", re.M)


@dataclasses.dataclass
class Snippet:
    page: pathlib.Path
    line: int  # of the opening fence, 1-based
    code: str
    hidden: bool = False  # a setup or check comment
    mirrored_by: tuple[str, str] | None = None  # (test file, test function)


def snippets(page: pathlib.Path) -> list[Snippet]:
    """The page's Python blocks and hidden code, in order, each block with the directive just before it."""
    found, lines = [], page.read_text().splitlines()
    mirrored, i = None, 0
    while i < len(lines):
        line = lines[i]
        if line.strip() in ("<!-- setup", "<!-- check"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->")
            found.append(Snippet(page, i + 1, "\n".join(lines[i + 1:end]) + "\n", hidden=True))
            i = end + 1
            continue
        if match := _MIRRORED.match(line.strip()):
            mirrored = (match[1], match[2])
        fence = _FENCE.match(line)
        if fence and fence[1]:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if fence[1] == "python":
                found.append(Snippet(page, i + 1, "\n".join(lines[i + 1:end]) + "\n", mirrored_by=mirrored))
            mirrored, i = None, end + 1
            continue
        i += 1
    return found


def ranks(page: pathlib.Path) -> int:
    """How many ranks the page's script runs on (1 unless it says `<!-- ranks: N -->`)."""
    match = _RANKS.search(page.read_text())
    return int(match[1]) if match else 1


def script(page: pathlib.Path) -> str:
    """The page's blocks that run here and its hidden code, in order, each marked with its line."""
    return "\n".join(f"# --- {page.relative_to(ROOT)}:{s.line}\n{s.code}" for s in snippets(page) if s.mirrored_by is None)
