"""The torch versions users pin, checked: `python -m bench.compat`.

For each environment below (torch 2.11.0, 2.14.1 and 2.15.0 on Python 3.11; Python 3.12 with
megatron-core 0.19), a virtual environment in a cache outside the checkout
(`$GRAPHPASS_COMPAT_CACHE`, else `$XDG_CACHE_HOME/graphpass/compat`, else `~/.cache/graphpass/compat`),
built once per machine and rebuilt when missing or when its specification changed, gets this
checkout installed (editable, no dependencies) and runs the compatibility subset: capture, every
pass, TRL, megatron-core's and slime's tensor-parallel Functions at 1 and 2 ranks with ranks
differing in grad mode, the torch stand-ins and the README's demo. torch 2.13.0 on Python 3.11 runs
the whole suite (`.ci/run`).

The environments are built all at once, with uv where it is installed (the `test` extra brings it:
parallel downloads, one cache that links the CUDA wheels the environments share), else with pip.
`--build` builds them and runs nothing, so that `.ci/run` can build them beside the suite.

Prints one row per environment; `--out FILE` also writes them as JSON. Exits non-zero when an
environment could not be built or one of its tests failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent

#: What each environment runs: the paths every torch version must keep working.
SUBSET = [
    "tests/analysis/test_capture.py",
    "tests/passes",
    "tests/integrations",
    "tests/tensor_parallel/test_vocab_parallel_functions.py",
    "tests/end_to_end/test_examples.py",
]


@dataclasses.dataclass(frozen=True)
class Environment:
    name: str
    python: str  # "3.11" or "3.12"
    packages: tuple[str, ...]  # installed first, with the checkout's `test` extra after them
    tests: tuple[str, ...] = tuple(SUBSET)


ENVIRONMENTS = [
    Environment("torch 2.11.0", "3.11", ("torch==2.11.0",)),  # verl 0.9.1, slime, NeMo-RL
    Environment("torch 2.14.1", "3.11", ("torch==2.14.1",)),  # vllm 0.33, sglang 0.5.23
    # The newest release, and the newest Triton (3.9, its pin): the generated kernels too.
    Environment("torch 2.15.0", "3.11", ("torch==2.15.0",), tuple(SUBSET) + ("tests/ops/test_kernels.py",)),
    # megatron-core >= 0.17 requires Python 3.12: its own loss and output layer code.
    Environment("python 3.12, megatron-core 0.19", "3.12", ("torch==2.13.0", "megatron-core>=0.19,<0.20"),
                tuple(SUBSET) + ("tests/tensor_parallel/test_megatron_output_layer.py",)),
]


def cache_dir() -> Path:
    if os.environ.get("GRAPHPASS_COMPAT_CACHE"):
        return Path(os.environ["GRAPHPASS_COMPAT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "graphpass" / "compat"


def _uv() -> str | None:
    """uv beside this interpreter (the `test` extra installs it) or on PATH; None: pip builds."""
    here = Path(sys.executable).parent / "uv"
    return str(here) if here.exists() else shutil.which("uv")


def find_python(version: str) -> str | None:
    """An interpreter of `version` ("3.12"): this one, `python3.12` on PATH or pyenv's, the first
    that runs as that version (pyenv's shims on PATH may not)."""
    candidates = [sys.executable, shutil.which(f"python{version}"),
                  *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))]
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
                              capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == version:
            return candidate
    return None


def _test_extra() -> list[str]:
    """The checkout's `test` extra: an environment built for another is rebuilt."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]["test"]


def _pip_environment() -> dict:
    # A machine-wide pip constraint may cap torch below the version an environment asks for;
    # each environment pins its own torch. uv's 30 s read timeout is short for wheels of GBs
    # downloaded four at a time beside the suite.
    return dict(os.environ, PIP_CONSTRAINT=os.devnull, UV_HTTP_TIMEOUT=os.environ.get("UV_HTTP_TIMEOUT", "300"))


def ensure(env: Environment) -> tuple[Path, str | None]:
    """(the environment's interpreter, None) once built; (…, why not) when it cannot be. Built anew
    when missing or when its Python or pinned packages changed; brought up to date in place when
    only the checkout's test extra changed."""
    folder = cache_dir() / re.sub(r"[^A-Za-z0-9.]+", "-", env.name)
    python = folder / "bin" / "python"
    marker = folder / "graphpass-compat.json"
    uv = _uv()
    pins = {"python": env.python, "packages": list(env.packages), "installer": "uv" if uv else "pip"}
    spec = dict(pins, test=_test_extra())
    built = json.loads(marker.read_text()) if python.exists() and marker.exists() else None
    if built == spec:
        return python, None
    # The test extra but its Triton: each CUDA build of torch pins its own (2.15's: 3.9), and the
    # subset runs no generated kernel.
    extra = [r for r in _test_extra() if not r.startswith("triton")]
    install = [uv, "pip", "install", "-q", "--python", str(python)] if uv else [str(python), "-m", "pip", "install", "-q"]
    steps = [install + [*env.packages, *extra, "-e", str(ROOT)]]
    if built is None or {k: built.get(k) for k in pins} != pins:
        interpreter = find_python(env.python)
        if interpreter is None:
            return python, f"no Python {env.python} on this machine"
        shutil.rmtree(folder, ignore_errors=True)
        venv = [uv, "venv", "-q", "--python", interpreter, str(folder)] if uv \
            else [interpreter, "-m", "venv", str(folder)]
        steps[:0] = [venv]
    for step in steps:
        done = subprocess.run(step, env=_pip_environment(), capture_output=True, text=True)
        if done.returncode != 0:  # once more: a download of GBs may stall on a busy machine
            done = subprocess.run(step, env=_pip_environment(), capture_output=True, text=True)
        if done.returncode != 0:
            return python, f"could not build it: {' '.join(step[:5])}: {_error_line(done.stderr)}"
    marker.write_text(json.dumps(spec))
    return python, None


def build_all(environments: list[Environment]) -> dict[str, tuple[Path, str | None, float]]:
    """Every environment built (or found built) at once: downloads overlap, and uv's one cache serves
    the CUDA wheels they share. Name -> (interpreter, why not or None, seconds)."""
    def timed(env):
        start = time.monotonic()
        python, why = ensure(env)
        return env.name, (python, why, round(time.monotonic() - start))

    with ThreadPoolExecutor(max_workers=len(environments) or 1) as pool:
        return dict(pool.map(timed, environments))


def run(env: Environment, workers: str, built: tuple[Path, str | None, float]) -> dict:
    """Install this checkout into `env` (`built` by `build_all`), run its tests: one result row."""
    start = time.monotonic()
    python, why, build_seconds = built
    row = dict(environment=env.name, torch=None, python=env.python, passed=0, failed=0, skipped=0, ok=False,
               build_seconds=build_seconds, seconds=None, note=why)
    if why is not None:
        return row
    uv = _uv()
    installer = [uv, "pip", "install", "--python", str(python)] if uv else [str(python), "-m", "pip", "install"]
    install = subprocess.run([*installer, "-q", "--no-deps", "-e", str(ROOT)],
                             env=_pip_environment(), capture_output=True, text=True)
    if install.returncode != 0:
        return dict(row, note=f"could not install graphpass: {_last_line(install.stderr)}")
    version = subprocess.run([str(python), "-c", "import torch, sys; print(torch.__version__, sys.version.split()[0])"],
                             capture_output=True, text=True, cwd=ROOT)
    row["torch"], row["python"] = (version.stdout.split() + [None, None])[:2]
    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:logging", "-n", workers, *env.tests],
                           capture_output=True, text=True, cwd=ROOT)
    counts = _counts(tests.stdout)
    row.update(counts, seconds=round(time.monotonic() - start), ok=tests.returncode == 0 and counts["passed"] > 0)
    if not row["ok"]:
        failures = [line for line in tests.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        row["note"] = "; ".join(failures[:5]) or _last_line(tests.stdout + tests.stderr)
    return row


def _counts(output: str) -> dict:
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    return {key: int(m.group(1)) if (m := re.search(rf"(\d+) {key}", summary)) else 0
            for key in ("passed", "failed", "skipped")}


def _error_line(text: str) -> str:
    """The installer's first line that says what went wrong (uv's hints come after it), else its last."""
    errors = [line for line in text.splitlines() if line.lstrip().lower().startswith(("error", "×", "caused by"))]
    return " ".join(errors)[:300] if errors else _last_line(text)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compat", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="environments whose name contains one of these")
    parser.add_argument("--workers", default="auto", help="pytest-xdist workers per environment (default: auto)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    parser.add_argument("--build", action="store_true", help="build the environments, run no test")
    args = parser.parse_args(argv)
    chosen = [e for e in ENVIRONMENTS if not args.only or any(o in e.name for o in args.only)]
    print(f"bench.compat: building {len(chosen)} environments in {cache_dir()} with {_uv() or 'pip'} ...", flush=True)
    built = build_all(chosen)
    for name, (_, why, seconds) in built.items():
        print(f"bench.compat: {name}: {'ready' if why is None else why} ({seconds} s)", flush=True)
    if args.build:
        return 0 if all(why is None for _, why, _ in built.values()) else 1
    rows = []
    for env in chosen:
        print(f"bench.compat: {env.name} ...", flush=True)
        rows.append(run(env, args.workers, built[env.name]))
        print(tabulate([rows[-1]], headers="keys"), flush=True)
    print(tabulate(rows, headers="keys"))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), rows=rows), indent=1) + "\n")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
