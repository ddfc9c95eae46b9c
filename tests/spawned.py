"""Multi-rank results computed once per test module: `once(body, world, timeout_s)`.

Each spawn of gloo ranks costs seconds (and a loaded machine's minutes), so a module runs every
case for a group size in one spawn (its body returns a dict, one entry per test's work) and its
tests read the results. A spawn that fails fails every test that reads
it, with the spawn's error (`bench.harness.ranks.RankFailed` names the rank and the collective)."""

from __future__ import annotations

import functools
import importlib

import pytest

from bench.harness.ranks import run_ranks


def once(body, world: int, timeout_s: float, *, args: tuple = (), requires: str | None = None):
    """A function returning `run_ranks(body, world, args=args, timeout_s=timeout_s)`'s per-rank
    results, spawned at its first call; without the module `requires` installed, each call skips."""

    @functools.cache
    def results():
        try:
            return run_ranks(body, world, args=args, timeout_s=timeout_s)
        except Exception as error:  # noqa: BLE001 - re-raised by every test that reads it
            return error

    def spawned():
        if requires is not None:
            pytest.importorskip(requires)
        out = results()
        if isinstance(out, Exception):
            raise out
        return out

    return spawned


def part(body, rank: int, world: int, *args):
    """Inside a rank: one test's work, `body(rank, world, *args)`, compiled from a fresh Dynamo (no
    graph, guard or automatic-dynamic size of an earlier part of the spawn)."""
    import torch

    torch._dynamo.reset()
    return body(rank, world, *args)


def installed(module: str) -> bool:
    """Whether `module` imports: inside a rank, work that needs it runs only where it does (the
    tests that read that work skip without it)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
