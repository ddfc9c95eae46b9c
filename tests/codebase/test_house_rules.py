"""Rules of the codebase that a reviewer would otherwise check by hand (issue 23): private torch
symbols live in `graphpass/_torch_api.py` alone, and no module (the benchmarks' included) imports
another's private name; no pass imports another (issue 48): what passes share lives in
`graphpass/`, and the registry (`passes/__init__.py`) alone runs passes."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted([*ROOT.glob("graphpass/**/*.py"), *ROOT.glob("passes/*.py")])
# torch._dynamo and torch._inductor are torch.compile's own public-facing packages (backends
# register with them); everything else private is reached through _torch_api.
PRIVATE_TORCH = re.compile(r"torch\.(?!_dynamo\b|_inductor\b)_[A-Za-z]|torch\.ops\._|\._schema\b|['\"]_schema['\"]"
                           r"|_overloadpacket")


def _sources():
    return [p for p in SOURCES if p.name != "_torch_api.py" and "graphpass/passes" not in p.as_posix()]


def test_private_torch_symbols_only_in_torch_api():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources()
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if PRIVATE_TORCH.search(line.split("#")[0])]
    assert not found, "private torch outside graphpass/_torch_api.py:\n" + "\n".join(found)


def test_no_private_name_imported_across_modules():
    found = []
    for p in [*_sources(), *sorted(ROOT.glob("bench/**/*.py"))]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                found += [f"{p.relative_to(ROOT)}:{node.lineno}: from {node.module or '.'} import {a.name}"
                          for a in node.names if a.name.startswith("_") and a.name != "_torch_api"]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_no_pass_imports_another():
    passes = sorted(p for p in ROOT.glob("passes/*.py") if p.name != "__init__.py")
    modules = {p.stem for p in passes}
    from graphpass.passes import PASS_NAMES
    packages = ("graphpass.passes", "passes")

    def imported(node):
        """(module, names) pairs a pass module's import statement names, packages spelled absolute."""
        if isinstance(node, ast.Import):
            return [(a.name, []) for a in node.names]
        if node.level:
            return [(".".join(filter(None, ("graphpass.passes", node.module))), [a.name for a in node.names])]
        return [(node.module, [a.name for a in node.names])]

    found = []
    for p in passes:
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for module, names in imported(node):
                if module in packages:  # the registry: its helpers, not its passes or their modules
                    bad = [f"{module}.{n}" for n in names if n in modules or n in PASS_NAMES]
                elif module.startswith(tuple(f"{package}." for package in packages)):
                    bad = [module]
                else:
                    bad = []
                found += [f"{p.relative_to(ROOT)}:{node.lineno}: imports {b}" for b in bad]
    assert not found, "a pass imports another pass:\n" + "\n".join(found)
