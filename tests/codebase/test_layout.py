"""The suite imports its own `tests` package beside an installed one of that name (verl's wheel ships a
top-level `tests`): `tests/` is a regular package, so neither Python nor pytest resolves `tests.helpers`
to site-packages (issue 57)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_test_folder_is_a_package():
    folders = {p.parent for p in ROOT.glob("tests/**/*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"test folders without __init__.py (a namespace package loses to site-packages' `tests`): {missing}"


def test_an_installed_tests_package_does_not_shadow_ours(tmp_path):
    # Where verl puts it: a regular package `tests` on the path, without our helpers.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("SHADOW = True\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--collect-only",
                           "tests/passes/test_tag_grad_flow.py", "tests/tensor_parallel/test_vocab_parallel_merge.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "error" not in done.stdout.lower(), done.stdout[-2000:]
