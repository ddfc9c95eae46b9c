"""Grad mode at each node, and the typed tag saying whether a node's gradient is ever needed."""

from __future__ import annotations

import numbers

import torch

from graphpass._torch_api import set_grad_enabled
from graphpass.analysis import catalogue

_GRAD_FLOWS = "graphpass.grad_flows"


def grad_modes(graph: torch.fx.Graph) -> dict:
    """Grad mode in force at each node, following `_set_grad_enabled` calls in graph order."""
    enabled, modes = torch.is_grad_enabled(), {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is set_grad_enabled:
            enabled = bool(node.args[0])
        modes[node] = enabled
    return modes


def set_grad_flows(node: torch.fx.Node, flows: bool) -> None:
    """Tag `node`: True iff it requires grad and a gradient from the graph outputs reaches it."""
    node.meta[_GRAD_FLOWS] = bool(flows)


def grad_flows(node: torch.fx.Node) -> bool | None:
    """The tag set by `passes.tag_grad_flow`, or None where the pass has not run."""
    return node.meta.get(_GRAD_FLOWS)


def _is_zero_constant(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool) and x == 0


def edges_carrying_grad(node, modes) -> list:
    """The inputs of `node` that receive a gradient from it (if it requires grad at all)."""
    if node.op != "call_function" or not modes[node] or node.target in catalogue.BLOCKS_GRAD:
        return []
    if node.target in catalogue.MULTIPLIES and any(_is_zero_constant(a) for a in node.args):
        return []  # a constant-0 coefficient: `0.0 * entropy.mean()`
    if node.target in catalogue.MASK_ARG:  # the boolean mask receives no gradient
        mask = node.args[catalogue.MASK_ARG[node.target]]
        return [a for a in node.all_input_nodes if a is not mask]
    return node.all_input_nodes


def requires_grad(gm: torch.fx.GraphModule, example_inputs, modes=None) -> dict:
    """Which nodes require grad (make_fx stores detached fake values, so it is derived from the
    example inputs, the grad mode at each node and the ops that pass a gradient)."""
    modes = grad_modes(gm.graph) if modes is None else modes
    requires = {}
    inputs = iter(example_inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            x = next(inputs, None)
            requires[node] = isinstance(x, torch.Tensor) and x.requires_grad
        else:
            requires[node] = any(requires.get(a, False) and a in edges_carrying_grad(node, modes)
                                 for a in node.all_input_nodes)
    return requires
