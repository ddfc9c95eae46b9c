"""Tag each node with whether its gradient can reach a differentiable graph output."""

from __future__ import annotations

import numbers

import torch

from graphpass.analysis import catalogue
from graphpass.analysis.grad_flow import grad_modes, set_grad_flows

aten = torch.ops.aten

__all__ = ["tag_grad_flow_pass"]

def _is_zero_constant(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool) and x == 0


def _edges_carrying_grad(node, modes):
    """The inputs of `node` that receive a gradient from it (if it requires grad at all)."""
    if node.op != "call_function" or not modes[node] or node.target in catalogue.BLOCKS_GRAD:
        return []
    if node.target in catalogue.MULTIPLIES and any(_is_zero_constant(a) for a in node.args):
        return []  # a constant-0 coefficient: `0.0 * entropy.mean()`
    if node.target in catalogue.MASK_ARG:  # the boolean mask receives no gradient
        mask = node.args[catalogue.MASK_ARG[node.target]]
        return [a for a in node.all_input_nodes if a is not mask]
    return node.all_input_nodes


def _requires_grad(gm, example_inputs, modes) -> dict:
    """Which nodes require grad. (make_fx stores detached fake values, so we derive it.)"""
    requires = {}
    inputs = iter(example_inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            x = next(inputs, None)
            requires[node] = isinstance(x, torch.Tensor) and x.requires_grad
        else:
            requires[node] = any(requires.get(a, False) and a in _edges_carrying_grad(node, modes)
                                 for a in node.all_input_nodes)
    return requires


def tag_grad_flow_pass(gm: torch.fx.GraphModule, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Tag each node (`graphpass.analysis.grad_flow.grad_flows`): True iff it requires grad and a gradient from
    the graph outputs can reach it.

    Blocked by detach, no_grad blocks, non-differentiable ops, and multiplication by a constant
    0 (Dynamo bakes a Python-float coefficient into the graph on first compile).
    """
    modes = grad_modes(gm.graph)
    nodes = list(gm.graph.nodes)
    requires = _requires_grad(gm, example_inputs, modes)
    flows = {n: False for n in nodes}
    for out in gm.graph.find_nodes(op="output"):
        for a in out.all_input_nodes:
            flows[a] = requires[a]
    for node in reversed(nodes):
        if flows[node]:
            for a in _edges_carrying_grad(node, modes):
                flows[a] = requires.get(a, False)
    for node in nodes:
        set_grad_flows(node, flows[node])
    return gm
