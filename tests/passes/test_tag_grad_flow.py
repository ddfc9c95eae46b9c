"""Unit tests of `tag_grad_flow_pass` on tiny captured graphs: which nodes a gradient can reach."""

from __future__ import annotations

import torch

from graphpass.analysis.grad_flow import grad_flows
from graphpass.passes.tag_grad_flow import tag_grad_flow_pass
from tests.helpers import run_passes

aten = torch.ops.aten


def tagged(fn, *args):
    """`fn`'s captured ATen graph after the pass: {op overload: [tag of each node calling it]}."""
    gm = run_passes(fn, *args, passes=[tag_grad_flow_pass]).gm
    tags = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            tags.setdefault(node.target, []).append(grad_flows(node))
    return tags


def x(requires_grad=True):
    return torch.randn(4, 5, requires_grad=requires_grad)


def test_detach_blocks_the_gradient():
    def f(x):
        y = x.sin()
        return (y.sum() + y.detach().cos().sum(),)

    tags = tagged(f, x())
    assert tags[aten.sin.default] == [True]
    assert tags[aten.cos.default] == [False]


def test_no_grad_block_is_gradient_free():
    def f(x):
        with torch.no_grad():
            w = x.exp()
        return ((x.sin() * w).sum(),)

    tags = tagged(f, x())
    assert tags[aten.exp.default] == [False]
    assert tags[aten.sin.default] == [True]


def test_multiplication_by_a_constant_zero_blocks_the_gradient():
    def f(x):
        return (x.sin().sum() + 0.0 * x.cos().sum(),)

    tags = tagged(f, x())
    assert tags[aten.sin.default] == [True]
    assert tags[aten.cos.default] == [False]


def test_a_nonzero_coefficient_keeps_the_gradient():
    def f(x):
        return (x.sin().sum() + 0.5 * x.cos().sum(),)

    tags = tagged(f, x())
    assert tags[aten.cos.default] == [True]


def test_a_mask_receives_no_gradient():
    def f(x):
        kept = torch.where(x.cos() > 0, x.sin(), 0.0)
        filled = x.tanh().masked_fill(x.exp() > 1, 0.0)
        return (kept.sum() + filled.sum(),)

    tags = tagged(f, x())
    assert tags[aten.sin.default] == [True] and tags[aten.tanh.default] == [True]
    assert tags[aten.cos.default] == [False] and tags[aten.exp.default] == [False]


def test_inputs_without_grad_tag_nothing():
    def f(x):
        return (x.sin().sum(),)

    tags = tagged(f, x(requires_grad=False))
    assert not any(t for ts in tags.values() for t in ts)
