"""graphpass.lint: warnings where torch.compile itself changes the math (one process, gloo, world 1)."""

from __future__ import annotations

import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import graphpass


@pytest.fixture(scope="module")
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _warnings_of(fn, *args):
    torch.compiler.reset()
    graphpass.lint._warned.clear()
    backend = graphpass.Backend(inner="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(fn, backend=backend)(*args)
    return [w for r in backend.records for w in r.warnings], [str(c.message) for c in caught]


def test_grad_carrying_inplace_all_reduce_is_named_with_its_line(world_of_one):
    def loss(x):
        y = x * 2
        dist.all_reduce(y)
        return y.sum()

    recorded, issued = _warnings_of(loss, torch.randn(4, requires_grad=True))
    assert len(recorded) == 1 and "test_lint.py:" in recorded[0] and "dist.all_reduce(y)" in recorded[0]
    assert recorded[0] in issued


@pytest.mark.parametrize("case", ["detached", "no_grad", "functional"])
def test_no_warning_where_compile_keeps_the_math(world_of_one, case):
    def loss(x):
        y = x * 2
        if case == "detached":
            z = y.detach()
            dist.all_reduce(z)
            return (y * z).sum()
        if case == "no_grad":
            with torch.no_grad():
                z = x * 3
                dist.all_reduce(z)
            return (y * z).sum()
        return funcol.all_reduce(y, "sum", dist.group.WORLD).sum()  # a backward the user chose

    recorded, issued = _warnings_of(loss, torch.randn(4, requires_grad=True))
    assert recorded == [] and not any("graphpass" in m for m in issued)
