"""Every Python snippet in README.md, CONTRIBUTING.md and docs/ runs (or names the test that runs
it), so the docs cannot drift from the code: see `snippets.py` for the directives."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.codebase.snippets import PAGES, ROOT, ranks, script, snippets

pytestmark = pytest.mark.heavy

RUN_PAGES = [p for p in PAGES if p.exists() and any(s.mirrored_by is None and not s.hidden for s in snippets(p))]
MIRRORED = [s for p in PAGES if p.exists() for s in snippets(p) if s.mirrored_by is not None]


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run in its own process group, killed whole (ranks included) at the deadline."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"timed out after {timeout_s:.0f} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out)


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_snippets_run(page, tmp_path):
    path = tmp_path / (page.stem.replace("-", "_") + ".py")
    path.write_text(script(page))
    n = ranks(page)
    launcher = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                f"--nproc-per-node={n}"]
    # Stretched by the machine's load, as the multi-rank tests' deadlines are.
    done = _run([*launcher, str(path)], timeout_s=300 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))
    assert done.returncode == 0, f"{page.relative_to(ROOT)}'s snippets failed:\n{done.stdout[-6000:]}"


@pytest.mark.parametrize("snippet", MIRRORED, ids=lambda s: f"{s.page.relative_to(ROOT)}:{s.line}")
def test_mirrored_snippet_names_a_test_that_names_its_page(snippet):
    test_file, test_name = snippet.mirrored_by
    tree = ast.parse((ROOT / test_file).read_text())
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == test_name]
    assert found, f"{snippet.page.name}:{snippet.line} names {test_file}::{test_name}, which does not exist"
    source = ast.get_source_segment((ROOT / test_file).read_text(), found[0])
    assert str(snippet.page.relative_to(ROOT)) in source, (
        f"{test_file}::{test_name} must say it runs the snippet of {snippet.page.relative_to(ROOT)} (name the page)")


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_readme_stays_short():
    """The README is the front page: details belong in docs/ (issue 48: at most 150 lines)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
